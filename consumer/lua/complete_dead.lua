-- ---------------------------------------------------------------- dead letters
local i = ctl.dead or 0
for _ = 1, (ctl.nd or 0) do
  local sk = ARGV[i]
  local entry_id = ARGV[i + 1]
  local nf = tonumber(ARGV[i + 2])
  local fresh
  if sk == '0' then
    fresh = id_above(entry_id, redis.call('HGET', worker, 'cancel_dead_letters_upto') or '0-0')
    if fresh then redis.call('HSET', worker, 'cancel_dead_letters_upto', entry_id) end
  else
    fresh = redis.call('XACK', KEYS[tonumber(sk)], group, entry_id) == 1
  end
  if fresh then
    redis.call('XADD', dlq, 'MAXLEN', '~', dmax, '*', unpack(ARGV, i + 3, i + 2 + 2 * nf))
    redis.call('HINCRBY', worker, 'dead_letters', 1)
  end
  i = i + 3 + 2 * nf
end
