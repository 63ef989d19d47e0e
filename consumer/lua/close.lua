-- close.lua: mark session accounting hashes closed (a cancel with nothing queued, a cancel of a
-- session this worker does not hold, an engine failure), without creating any hash: only a session
-- that was charged something has one. A hash already closed keeps its first closure.
-- KEYS: session accounting hashes. ARGV: the closure kind of each ('finished', 'cancelled', 'failed').
-- Returns how many were closed by this call.
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 and redis.call('HSETNX', key, 'closed', ARGV[i]) == 1 then
    n = n + 1
  end
end
return n
