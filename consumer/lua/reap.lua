-- reap.lua: cancel one session if it is still open and idle past the TTL.
-- KEYS[1] session accounting hash, KEYS[2] its result stream, KEYS[3] the cancellation stream,
-- KEYS[4] the session's cancel marker (a cancel is state: it wins over a replay, see producer/client.py).
-- ARGV[1] session id, [2] ttl ms, [3] cancellation maxlen, [4] who, [5] '1' for a dry run,
-- [6] cancel marker ttl s.
-- Returns {status, idle_ms}: status 'cancelled' | 'idle' (dry run) | 'active' | 'closed' | 'reaped'
-- | 'unknown' (never held: no account) | 'gone'; idle_ms -1 when the result stream is gone.
local session, results, cancel = KEYS[1], KEYS[2], KEYS[3]
if redis.call('EXISTS', session) == 0 then
  return {'gone', -1}
end
local st = redis.call('HMGET', session, 'closed', 'reaped', 'account')
if st[1] then return {'closed', -1} end
if st[2] then return {'reaped', -1} end
if not st[3] then return {'unknown', -1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local last = redis.call('XREVRANGE', results, '+', '-', 'COUNT', 1)
local idle = -1
if #last > 0 then
  idle = now - tonumber(string.match(last[1][1], '^(%d+)'))
  if idle < tonumber(ARGV[2]) then
    return {'active', idle}
  end
end
if ARGV[5] == '1' then
  return {'idle', idle}
end
redis.call('SET', KEYS[4], '1', 'EX', ARGV[6])
redis.call('XADD', cancel, 'MAXLEN', '~', ARGV[3], '*', 'session_id', ARGV[1])
redis.call('HSET', session, 'reaped', t[1], 'reaped_by', ARGV[4])
return {'cancelled', idle}
