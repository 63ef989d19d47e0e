-- recover.lua: recovery by ownership. Take over the pending entries of every OTHER consumer of the
-- group on every given stream (XCLAIM into this consumer, min idle 0): the caller holds the worker's
-- lease, so any other consumer name is a process that no longer does (crashed, fenced, or an older
-- name). Entries this consumer read stay its own however long they wait: idle time decides nothing.
-- Entries delivered more than max_deliveries times (the claim counts) are dead-lettered: XADD to the
-- dead-letter stream with the reason and the original fields (prefixed 'f:'), then XACK, atomically,
-- so a crash duplicates rather than loses. Emptied consumers are deleted from the group.
--
-- KEYS[1] dead-letter stream, KEYS[2..] input streams.
-- ARGV[1] group, [2] consumer, [3] max entries claimed per stream,
-- [4] max deliveries, [5] dead-letter maxlen, [6] max fields copied.
-- Returns per stream {kept, dead, own}: kept = {{id, deliveries, {f, v, ...}}, ...},
-- dead = {{id, deliveries, {f, v, ...}}, ...}, own = this consumer's pending count before the claim.

local group, consumer = ARGV[1], ARGV[2]
local budget0 = tonumber(ARGV[3])
local maxd = tonumber(ARGV[4])
local dmax = ARGV[5]
local maxf = tonumber(ARGV[6])
local dead_letter = dead_letterer(KEYS[1], dmax, maxf, group, consumer, maxd)

local out = {}
for s = 2, #KEYS do
  local stream = KEYS[s]
  local kept, dead = {}, {}
  local own = 0
  local budget = budget0
  local summary = redis.call('XPENDING', stream, group)
  local owners = summary[4]
  if type(owners) ~= 'table' then owners = {} end
  for _, o in ipairs(owners) do
    local name, count = o[1], tonumber(o[2])
    if name == consumer then
      own = count
    elseif budget > 0 then
      local n = math.min(count, budget)
      local pending = redis.call('XPENDING', stream, group, '-', '+', n, name)
      local ids = {}
      for _, p in ipairs(pending) do
        ids[#ids + 1] = p[1]
      end
      if #ids > 0 then
        local claimed = redis.call('XCLAIM', stream, group, consumer, 0, (unpack or table.unpack)(ids))
        local got = {}
        for _, e in ipairs(claimed) do
          if type(e) == 'table' then
            got[e[1]] = e[2] or {}
          end
        end
        for _, id in ipairs(ids) do
          local fields = got[id]
          local deliveries = deliveries_of(stream, group, id)
          if deliveries then  -- still pending (a trimmed entry may have been dropped by XCLAIM)
            fields = fields or {}
            if deliveries > maxd then
              dead_letter(stream, id, deliveries, fields)
              dead[#dead + 1] = {id, tostring(deliveries), fields}
            else
              kept[#kept + 1] = {id, tostring(deliveries), fields}
            end
          end
        end
        budget = budget - #ids
      end
      if n >= count then
        redis.call('XGROUP', 'DELCONSUMER', stream, group, name)
      end
    end
  end
  out[#out + 1] = {kept, dead, own}
end
return out
