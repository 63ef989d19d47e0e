-- ---------------------------------------------------------------- acks, input blobs
for _, a in ipairs(ctl.acks or {}) do
  redis.call('XACK', KEYS[a[1]], group, unpack(a[2]))
end
for _, k in ipairs(ctl.del or {}) do
  redis.call('DEL', KEYS[k])
end

-- ---------------------------------------------------------------- closures, the tally
local acct_ids = ctl.accounts or {}
local closing = {}
for _, c in ipairs(ctl.close or {}) do
  local sid = c[1]
  if moved[sid] then
    redis.call('HDEL', KEYS[8], sid)
  end
  if L[sid] ~= nil then
    closing[sid] = c[3]
    sk[sid] = c[2]
    if c[4] > 0 then ac[sid] = c[4] end
  elseif redis.call('EXISTS', KEYS[c[2]]) == 1 then
    redis.call('HSETNX', KEYS[c[2]], 'closed', c[3])  -- nothing charged since it closed: mark it, create nothing
  end
end
do
  local pairs_, np = {}, 0  -- field, value, ...: the first np of them to write
  for sid, e in pairs(L) do
    local a = ac[sid]
    local account = a ~= nil and acct_ids[a][2] or e[ACCOUNT]
    if closing[sid] or late[sid] then
      -- Folded into the session hash: a closing session's entry, or a late one (see entry()).
      if dirty[sid] or closing[sid] then
        local hk = KEYS[sk[sid]]
        redis.call('HINCRBY', hk, 'prompt_tokens', int(e[PROMPT]))
        redis.call('HINCRBY', hk, 'generated_tokens', int(e[GEN]))
        redis.call('HINCRBY', hk, 'recomputed_tokens', int(e[RECOMP]))
        redis.call('HINCRBY', hk, 'steps', int(e[STEPS]))
        redis.call('HINCRBYFLOAT', hk, 'engine_seconds', fmt(e[ES]))
        redis.call('HSET', hk, 'att', int(e[ATT]), 'pub', int(e[PUB]), 'hw', int(e[HW]), 'gaps', gaps_text(sid, e),
          'owed', owed_text(sid, e))
        if account ~= '' then
          redis.call('HSET', hk, 'account', account)
        end
        if closing[sid] then
          redis.call('HSETNX', hk, 'closed', closing[sid])
        end
        redis.call('EXPIRE', hk, ttl)
      end
      if stored[sid] then
        redis.call('HDEL', tally, sid)
      end
    elseif dirty[sid] then
      -- gaps_text and owed_text, without their calls where the call never parsed the lists (every call but
      -- after a loss of data)
      local g = gl[sid] == nil and e[GAPS] or gaps_text(sid, e)
      local o = ol[sid] == nil and e[OWED] or owed_text(sid, e)
      np = np + 2
      pairs_[np - 1], pairs_[np] = sid, struct.pack(TALLY, e[ATT], e[PUB], e[HW], e[PROMPT], e[GEN], e[RECOMP],
        e[STEPS], e[ES], now, #g, g, #account, account, #o, o)
      if np >= 2000 then
        redis.call('HSET', tally, unpack(pairs_, 1, np))
        np = 0
      end
    end
  end
  if np > 0 then
    redis.call('HSET', tally, unpack(pairs_, 1, np))
  end
end
for n, s in pairs(accounts) do
  local key = KEYS[acct_ids[n][1]]
  redis.call('HINCRBY', key, 'prompt_tokens', int(s[1]))
  redis.call('HINCRBY', key, 'generated_tokens', int(s[2]))
  redis.call('HINCRBY', key, 'steps', int(s[4]))
  if s[3] > 0 then
    redis.call('HINCRBY', key, 'recomputed_tokens', int(s[3]))
  end
  if s[6] > 0 then
    redis.call('HINCRBY', key, 'cached_tokens', int(s[6]))
  end
  redis.call('HINCRBYFLOAT', key, 'engine_seconds', fmt(s[5]))
  redis.call('SADD', index, acct_ids[n][2])
end
if w_steps > 0 then
  redis.call('HINCRBY', worker, 'steps', int(w_steps))
  redis.call('HINCRBY', worker, 'prompt_tokens', int(w_prompt))
  redis.call('HINCRBY', worker, 'generated_tokens', int(w_gen))
  if w_recomp > 0 then
    redis.call('HINCRBY', worker, 'recomputed_tokens', int(w_recomp))
  end
  if w_cached > 0 then
    redis.call('HINCRBY', worker, 'cached_tokens', int(w_cached))
  end
  redis.call('HINCRBYFLOAT', worker, 'engine_seconds_share', fmt(w_share))
  for status, k in pairs(by_status) do
    redis.call('HINCRBY', worker, 'results:' .. status, int(k))
  end
end
