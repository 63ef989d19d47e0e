-- acquire.lua: take worker W's lease when it is free (or when `steal` names the current holder,
-- which the caller found dead), as a new epoch.
-- KEYS[1] lease, KEYS[2] epoch. ARGV[1] instance id, [2] lease ms, [3] holder to replace ('' none).
-- Returns {1, token} when acquired, {0, holder} when another process holds it.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[3] then
  return {0, holder}
end
local epoch = redis.call('INCR', KEYS[2])
local token = tostring(epoch) .. ':' .. ARGV[1]
redis.call('SET', KEYS[1], token, 'PX', ARGV[2])
return {1, token}
