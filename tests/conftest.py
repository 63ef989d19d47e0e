pytest_plugins = ["tests.fixtures.redis_server", "tests.fixtures.models", "tests.fixtures.cluster"]
