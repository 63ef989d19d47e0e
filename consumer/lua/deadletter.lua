-- deadletter.lua: the dead-letter block shared by pending.lua and recover.lua, prepended to each when it is loaded
-- (consumer/lua/__init__.py: SCRIPTS), since a Redis script cannot include another.
--
-- Moves one entry to the dead-letter stream with the reason and the original fields (prefixed 'f:',
-- at most maxf of them), then XACKs it: in this order, inside one script, so a crash duplicates a
-- dead letter rather than loses the entry.
local function move_to_dead_letters(dlq, dmax, maxf, group, consumer, maxd, stream, id, deliveries, fields)
  local args = {'reason', 'too_many_deliveries',
                'detail', 'delivered ' .. deliveries .. ' times (max ' .. maxd .. ')',
                'stream', stream, 'entry_id', id, 'deliveries', tostring(deliveries), 'consumer', consumer}
  local n = 0
  for j = 1, #fields, 2 do
    n = n + 1
    if n > maxf then break end
    args[#args + 1] = 'f:' .. fields[j]
    args[#args + 1] = fields[j + 1]
  end
  redis.call('XADD', dlq, 'MAXLEN', '~', dmax, '*', (unpack or table.unpack)(args))
  redis.call('XACK', stream, group, id)
end

-- dead_letter(stream, id, deliveries, fields) for a script's own dead-letter stream and limits.
local function dead_letterer(dlq, dmax, maxf, group, consumer, maxd)
  return function(stream, id, deliveries, fields)
    move_to_dead_letters(dlq, dmax, maxf, group, consumer, maxd, stream, id, deliveries, fields)
  end
end

-- How many times entry `id` was delivered (XPENDING of that one entry), or nil when it is no longer pending.
local function deliveries_of(stream, group, id)
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if p[1] then return tonumber(p[1][4]) or 0 end
  return nil
end
