-- pending.lua: re-read this consumer's own pending entries (XREADGROUP with an explicit id), in one
-- round trip for several streams, dead-lettering those delivered more than max_deliveries times
-- (a poison entry that crashes the worker would otherwise come back after every restart).
--
-- KEYS[1] dead-letter stream, KEYS[2..] input streams.
-- ARGV[1] group, [2] consumer, [3] max deliveries, [4] dead-letter maxlen, [5] max fields copied,
-- then per stream: cursor (last pending id already re-read, '0' at start), count.
-- Returns per stream {kept, dead, scanned, last_id}: kept = {{id, {f, v, ...}}, ...},
-- dead = {{id, deliveries, {f, v, ...}}, ...}; scanned < count means the pending list is drained.

local unpack = unpack or table.unpack
local group, consumer = ARGV[1], ARGV[2]
local maxd = tonumber(ARGV[3])
local dmax = ARGV[4]
local maxf = tonumber(ARGV[5])
local dead_letter = dead_letterer(KEYS[1], dmax, maxf, group, consumer, maxd)

local function entries_of(r)
  -- {{stream, entries}}
  if not r or not r[1] then return {} end
  return r[1][2] or {}
end

local out = {}
for s = 2, #KEYS do
  local stream = KEYS[s]
  local cursor = ARGV[6 + (s - 2) * 2]
  local count = ARGV[7 + (s - 2) * 2]
  local r = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', stream, cursor)
  local kept, dead = {}, {}
  local scanned, last = 0, cursor
  for _, e in ipairs(entries_of(r)) do
    local id = e[1]
    local fields = e[2] or {}  -- a deleted (trimmed) entry still pending has no fields
    scanned = scanned + 1
    last = id
    local deliveries = deliveries_of(stream, group, id) or 0
    if deliveries > maxd then
      dead_letter(stream, id, deliveries, fields)
      dead[#dead + 1] = {id, tostring(deliveries), fields}
    else
      kept[#kept + 1] = {id, fields}
    end
  end
  out[#out + 1] = {kept, dead, scanned, last}
end
return out
