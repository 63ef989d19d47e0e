-- release.lua: give the lease back on a clean exit, only if this token still holds it.
-- KEYS[1] lease. ARGV[1] token. Returns 1 when released.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
