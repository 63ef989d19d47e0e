-- ---------------------------------------------------------------- rows: publish
-- Each row once only (its tally entry or its `res` marker), charged by charge() (complete_charge.lua)
-- when its session has a billing account; each record XADDed with its charges unless no row is fresh.
-- (The hot loop of the worker's hot path: columns held in locals, no string built per row unless the
-- row needs one, sums in locals. Lua 5.1 runs each operation in tens of nanoseconds.)
local w_prompt, w_gen, w_recomp, w_steps, w_share, w_ok, w_cached = 0, 0, 0, 0, 0.0, 0, 0
local by_status = {}
local STATUS = {'cancelled', 'rejected', 'state_lost', 'failed'}
local out = {}
local n_rows, n_fresh = 0, 0
local STEADY = true  -- the steady decode token's block (below); false: every row takes the general path

local function one(col)  -- a column's one value, or false where it is a column (a table)
  if type(col) == 'table' then return false end
  return col
end

local function put_blob(blob, i)  -- row i's output rows (a hop's activations), when it has any
  local b = blob[tostring(i - 1)]
  if b ~= nil then
    redis.call('SET', KEYS[b[1]], ARGV[b[2]], 'EX', act_ttl)
  end
end

for ri, rec in ipairs(ctl.records) do
  local R = rec.R
  local Rsid, Rst, Rpos, Ratt, Rfrm, Rfed, Rtok, Res = R.sid, R.st, R.pos, R.att, R.frm, R.fed, R.tok, R.es
  -- st, att, fed and es come as one value when every row has the same (publish.py one_value): false, a column
  local st_all, att_all, fed_all, es_all = one(Rst), one(Ratt), one(Rfed), one(Res)
  local Rkc = R.kc  -- only when a row restored positions from the prefix cache
  local acct, skey, res, blob = rec.acct, rec.skey, rec.res, rec.blob
  local has_blob = next(blob) ~= nil
  local n = #Rsid
  local P, G, RC, D, K = {}, {}, {}, {}, {}
  local any_k = false
  local any_acct, published = false, 0
  for i = 1, n do
    local st, pos, a = st_all or Rst[i], Rpos[i], acct[i]
    local att, fed, es = att_all or Ratt[i], fed_all or Rfed[i], es_all or Res[i]
    local sid = Rsid[i]
    local e = nil
    if a > 0 then
      e = L[sid]
      if e == nil then
        e = entry(sid, skey[i])
      end
      sk[sid], ac[sid] = skey[i], a
    end
    if STEADY and e ~= nil and st == 0 and pos == e[HW] and pos > e[PUB] and fed == 0 and Rtok[i] >= 0
        and att == e[ATT] and Rfrm[i] <= e[PUB] and not moved[sid] then
      -- The steady decode token: ok, billed, of the session's attempt (an entry made from nothing has attempt -1,
      -- so none is steady), following its last published answer (no gap), its token at the high-water mark
      -- (nothing owed), no prompt position fed. The general path below does exactly this for it (the fresh
      -- test, charge(), the sums) through a call and a dozen tests that cannot fail here; a call of decode rows
      -- is made of these. tests/test_complete_steady.py files any answers with STEADY false and compares every key.
      e[PUB], e[HW], e[GEN], e[STEPS], e[ES] = pos, pos + 1, e[GEN] + 1, e[STEPS] + 1, e[ES] + es
      dirty[sid] = true
      local s = accounts[a]  -- as charge() makes it: inline, since a Lua call costs about 1 % of a row here
      if s == nil then
        s = {0, 0, 0, 0, 0.0, 0}
        accounts[a] = s
      end
      s[2], s[4], s[5] = s[2] + 1, s[4] + 1, s[5] + es
      published, any_acct = published + 1, true
      w_gen, w_steps, w_share, w_ok = w_gen + 1, w_steps + 1, w_share + es, w_ok + 1
      P[i], G[i], RC[i], K[i] = '0', '1', '0', '0'  -- as text: table.concat formats a number by sprintf
      if has_blob then put_blob(blob, i) end
    else
      local fresh
      local fence = a > 0 and moved[sid]
      if fence and att <= fence then
        fresh = false  -- moved off this worker with this attempt (complete.lua's header)
      elseif st == 0 and e ~= nil then
        local eatt = e[ATT]
        if att > eatt or (att == eatt and pos > e[PUB]) then
          fresh = true
          local frm = Rfrm[i]
          if att > eatt then  -- a newer attempt starts afresh (a replay's first answer starts at position 0)
            gl[sid] = {}
            add_gap(sid, e, 1, frm)
          elseif fresh_e[sid] then
            add_gap(sid, e, 1, frm)  -- a result's position is at least 1: every answer computed a position
          elseif frm > e[PUB] then
            add_gap(sid, e, e[PUB] + 1, frm)
          end
          e[ATT], e[PUB] = att, pos
          if fresh_e[sid] then fresh_e[sid] = nil end
        else
          fresh = att == eatt and take_gap(sid, e, pos)
        end
      elseif st == 0 then
        fresh = true
      else
        fresh = redis.call('SET', KEYS[res[tostring(i - 1)]], '1', 'NX', 'EX', a > 0 and ttl or rttl) ~= false
      end
      local p, g, rc, k = 0, 0, 0, 0
      if fresh then
        published = published + 1
        if e ~= nil then
          p, g, rc, k = charge(sid, e, a, pos, fed, Rtok[i] >= 0, es, Rkc and Rkc[i] or 0)
          if k > 0 then
            any_k, w_cached = true, w_cached + k
          end
          any_acct = true
        end
        w_prompt, w_gen, w_recomp = w_prompt + p, w_gen + g, w_recomp + rc
        w_steps, w_share = w_steps + 1, w_share + es
        if st == 0 then
          w_ok = w_ok + 1
        else
          local name = STATUS[st]
          by_status[name] = (by_status[name] or 0) + 1
        end
        if has_blob then put_blob(blob, i) end
      else
        D[#D + 1] = i - 1
      end
      P[i], G[i], RC[i], K[i] = p, g, rc, k
    end
  end
  n_rows, n_fresh = n_rows + n, n_fresh + published
  local charges = '{"p":[' .. table.concat(P, ',') .. '],"g":[' .. table.concat(G, ',') .. '],"r":[' ..
    table.concat(RC, ',') .. '],"d":[' .. table.concat(D, ',') .. ']' ..
    (any_k and (',"k":[' .. table.concat(K, ',') .. ']}') or '}')
  out[ri] = charges
  if published > 0 then
    local stream = KEYS[rec.out]
    redis.call('XADD', stream, 'MAXLEN', '~', rmax, '*', 'v', '2', 'r', ARGV[rec.r], 'c', charges)
    if any_acct then
      redis.call('EXPIRE', stream, ttl)
    else
      expire_at_least(stream, rttl)
    end
  end
end
if w_ok > 0 then
  by_status['ok'] = w_ok
end
