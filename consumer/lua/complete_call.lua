-- ---------------------------------------------------------------- the fused call
-- Counted unless every answer given was one published already (a replayed completion).
local call = ctl.call
if call ~= nil and call ~= cjson.null and (n_rows == 0 or n_fresh > 0) then
  local phase, sessions = call[1], int(call[2])
  redis.call('HINCRBY', worker, 'fused_calls', 1)
  redis.call('HINCRBY', worker, 'calls:' .. phase, 1)
  redis.call('HINCRBY', worker, 'sessions:' .. phase, sessions)
  redis.call('HINCRBY', worker, 'tokens:' .. phase, int(call[3]))
  redis.call('HINCRBY', worker, 'batch_size:' .. sessions, 1)
  redis.call('HINCRBYFLOAT', worker, 'engine_seconds', call[4])
end

return out
