-- replay.lua: replay one dead letter into its original input stream, at most once, with an audit.
-- KEYS[1] dead-letter stream, KEYS[2] the original input stream, KEYS[3] replay marker,
-- KEYS[4] audit stream. ARGV[1] dead-letter id, [2] who, [3] note, [4] marker ttl s (0: none),
-- [5] audit maxlen.
-- Returns {'replayed', new_id} | {'already', new_id} | {'missing'} | {'mismatch', stream} | {'empty'}.
local unpack = unpack or table.unpack
local dlq, target, marker, audit = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local e = redis.call('XRANGE', dlq, ARGV[1], ARGV[1])
if #e == 0 then
  return {'missing'}
end
local fields = e[1][2]
local stream, entry, reason = nil, '', ''
local fwd = {}
for j = 1, #fields, 2 do
  local k, v = fields[j], fields[j + 1]
  if k == 'stream' then stream = v
  elseif k == 'entry_id' then entry = v
  elseif k == 'reason' then reason = v
  elseif string.sub(k, 1, 2) == 'f:' then
    fwd[#fwd + 1] = string.sub(k, 3)
    fwd[#fwd + 1] = v
  end
end
if stream ~= target then
  return {'mismatch', stream or ''}
end
if #fwd == 0 then
  return {'empty'}
end
local prev = redis.call('GET', marker)
if prev then
  return {'already', prev}
end
local id = redis.call('XADD', target, '*', unpack(fwd))
if tonumber(ARGV[4]) > 0 then
  redis.call('SET', marker, id, 'NX', 'EX', ARGV[4])
else
  redis.call('SET', marker, id, 'NX')
end
local t = redis.call('TIME')
redis.call('XADD', audit, 'MAXLEN', '~', ARGV[5], '*', 'who', ARGV[2],
           'at', t[1] .. '.' .. string.format('%06d', tonumber(t[2])), 'dlq_id', ARGV[1], 'stream', target,
           'entry_id', entry, 'new_id', id, 'reason', reason, 'note', ARGV[3])
return {'replayed', id}
