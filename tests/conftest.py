pytest_plugins = ["tests.fixtures.lua_struct", "tests.fixtures.redis_server", "tests.fixtures.models",
                  "tests.fixtures.cluster"]
