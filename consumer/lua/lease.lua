-- lease.lua: prepended to every script that writes as the worker's lease holder (complete.lua,
-- renew.lua), since a Redis script cannot include another.
--
-- The lease key holds '<epoch>:<instance>' of the one consumer process allowed to serve worker W; the
-- epoch key counts acquisitions. A holder whose lease merely lapsed (a long pause, a Redis outage
-- longer than the lease) takes it back when nobody acquired it since (the epoch is unchanged): its
-- sessions are still its own. When another process acquired it meanwhile, the old holder is fenced:
-- the script refuses to write anything. An epoch key that is missing or lower than the holder's
-- means Redis lost writes (a restart without persistence, or the last second of an AOF everysec):
-- epochs only grow, so the holder restores its own rather than being fenced by the loss.
local function hold_lease(lease, epoch_key, token, epoch, lease_ms)
  local holder = redis.call('GET', lease)
  if holder == token then
    return true
  end
  if holder then
    return false
  end
  local current = tonumber(redis.call('GET', epoch_key) or '0')
  if current > tonumber(epoch) then
    return false
  end
  if current < tonumber(epoch) then
    redis.call('SET', epoch_key, epoch)
  end
  redis.call('SET', lease, token, 'PX', lease_ms)
  return true
end
