-- reap.lua: cancel one session if it is still open and idle past the TTL.
-- KEYS[1] the worker's tally hash (docs/accounting.md: one field per open session, whose `t` is the
-- server's clock at its last answer), KEYS[2] the cancellation stream, KEYS[3] the session's cancel
-- marker (a cancel is state: it wins over a replay, see producer/client.py).
-- ARGV[1] session id, [2] ttl ms, [3] cancellation maxlen, [4] who, [5] '1' for a dry run,
-- [6] cancel marker ttl s.
-- Returns {status, idle_ms}: status 'cancelled' | 'idle' (dry run) | 'active' | 'reaped' (cancelled
-- already: its cancel marker is set) | 'gone' (no open tally: closed, or never charged); idle_ms -1
-- when unknown.
local tally, cancel, marker = KEYS[1], KEYS[2], KEYS[3]
local v = redis.call('HGET', tally, ARGV[1])
if not v then
  return {'gone', -1}
end
if redis.call('EXISTS', marker) == 1 then
  return {'reaped', -1}
end
local last = select(9, struct.unpack('<llllllldlHc0Hc0Hc0', v))  -- its `t` (schemas/accounting.py: the layout)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local idle = last and (now - last * 1000) or -1
if idle >= 0 and idle < tonumber(ARGV[2]) then
  return {'active', idle}
end
if ARGV[5] == '1' then
  return {'idle', idle}
end
redis.call('SET', marker, 'reaped by ' .. ARGV[4] .. ' at ' .. t[1], 'EX', ARGV[6])
redis.call('XADD', cancel, 'MAXLEN', '~', ARGV[3], '*', 'session_id', ARGV[1])
return {'cancelled', idle}
