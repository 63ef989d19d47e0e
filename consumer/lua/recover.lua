-- recover.lua: take over entries idle longer than min_idle on every given stream (XAUTOCLAIM into
-- this consumer: a restarted worker under a new consumer name takes back its stream), and
-- dead-letter those delivered more than max_deliveries times: XADD to the dead-letter stream with
-- the reason and the original fields (prefixed 'f:'), then XACK, atomically, so a crash duplicates
-- rather than loses.
--
-- KEYS[1] dead-letter stream, KEYS[2..] input streams.
-- ARGV[1] group, [2] consumer, [3] min idle ms, [4] max entries claimed per stream,
-- [5] max deliveries, [6] dead-letter maxlen, [7] max fields copied.
-- Returns per stream {kept, dead}: kept = {{id, deliveries, {f, v, ...}}, ...},
-- dead = {{id, deliveries, {f, v, ...}}, ...}.

local unpack = unpack or table.unpack
local group, consumer = ARGV[1], ARGV[2]
local min_idle = ARGV[3]
local budget0 = tonumber(ARGV[4])
local maxd = tonumber(ARGV[5])
local dmax = ARGV[6]
local maxf = tonumber(ARGV[7])
local dlq = KEYS[1]

local function dead_letter(stream, id, deliveries, fields)
  move_to_dead_letters(dlq, dmax, maxf, group, consumer, maxd, stream, id, deliveries, fields)
end

local out = {}
for s = 2, #KEYS do
  local stream = KEYS[s]
  local kept, dead = {}, {}
  local cursor = '0-0'
  local budget = budget0
  local rounds = 0
  repeat
    local r = redis.call('XAUTOCLAIM', stream, group, consumer, min_idle, cursor, 'COUNT', budget)
    cursor = r[1]
    local claimed = r[2] or {}
    for _, e in ipairs(claimed) do
      local id = e[1]
      local fields = e[2] or {}
      local p = redis.call('XPENDING', stream, group, id, id, 1)
      local deliveries = (p[1] and tonumber(p[1][4])) or 0
      if deliveries > maxd then
        dead_letter(stream, id, deliveries, fields)
        dead[#dead + 1] = {id, tostring(deliveries), fields}
      else
        kept[#kept + 1] = {id, tostring(deliveries), fields}
      end
    end
    budget = budget - #claimed
    rounds = rounds + 1
  until cursor == '0-0' or budget <= 0 or rounds >= 64
  out[#out + 1] = {kept, dead}
end
return out
