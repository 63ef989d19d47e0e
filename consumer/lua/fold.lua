-- fold.lua: fold one worker's snapshot of one account's counters into the account's ledger.
-- KEYS[1] ledger hash, KEYS[2] ledger index set (both in the {ledger} slot).
-- ARGV[1] account id, ARGV[2] worker id, ARGV[3] n, then n triples: counter, kind ('i'|'f'), value.
-- Returns {1, counter, delta, ...} folded | {0} nothing new | {-1, counter, watermark, value} stale.
local ledger, index = KEYS[1], KEYS[2]
local aid, w = ARGV[1], ARGV[2]
local n = tonumber(ARGV[3])
local prefix = 'w:' .. w .. ':'
local old, cur = {}, {}
local changed = false
for j = 0, n - 1 do
  local f, v = ARGV[4 + 3 * j], ARGV[6 + 3 * j]
  local mark = redis.call('HGET', ledger, prefix .. f)
  local o, c = tonumber(mark or '0'), tonumber(v)
  if c < o then
    return {-1, f, mark, v}
  end
  if c ~= o then changed = true end
  old[j], cur[j] = o, c
end
if not changed then
  return {0}
end
local out = {1}
for j = 0, n - 1 do
  local f, kind, v = ARGV[4 + 3 * j], ARGV[5 + 3 * j], ARGV[6 + 3 * j]
  local d = cur[j] - old[j]
  if d ~= 0 then
    if kind == 'i' then
      redis.call('HINCRBY', ledger, f, string.format('%d', d))
    else
      redis.call('HINCRBYFLOAT', ledger, f, string.format('%.17g', d))
    end
    redis.call('HSET', ledger, prefix .. f, v)
    out[#out + 1] = f
    out[#out + 1] = string.format('%.17g', d)
  end
end
local t = redis.call('TIME')
redis.call('HINCRBY', ledger, 'folds', 1)
redis.call('HSET', ledger, 'folded_at', t[1] .. '.' .. string.format('%06d', tonumber(t[2])))
redis.call('SADD', index, aid)
return out
