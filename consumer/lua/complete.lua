-- complete.lua: file one completion call (a fused call's answers, and what was answered without a call
-- in the same loop iteration) in one round trip: wire version 2 (docs/wire-format.md, accounting.md).
--
-- Runs after lease.lua. When a lease token is given, the script first checks that this process still
-- holds the worker's lease (or takes it back if it lapsed and nobody took it since); a fenced process
-- gets the error DGRFENCED and nothing is written. Then the call guard: KEYS[7] holds '<epoch> <seq>' of
-- the last call filed; a call of the same epoch with a sequence not above it is a completion re-sent
-- after a reconnect whose first send ran: nothing is written again ('DUP').
--
-- Each record (one per result stream) holds the answers as columns (row i = one answer). Per row:
--   * once only: an ok row by its session's tally entry (published when its (attempt, position) is
--     above the last ok answer published for the session, or inside a gap), a row that is not ok by
--     `SET NX` of its result id's marker (`res` key). A row that is not fresh is neither published nor
--     charged: its index goes to the charges' `d` list;
--   * charged (rows with a billing account): prompt positions fed (`fed`, the positions pos - fed ..
--     pos - 1) at or above the session's charged high-water mark `hw` or owed (below), the rest
--     recomputed; a sampled token at position pos >= hw or owed; then hw moves past them. So every
--     prompt position and every sampled token is charged once per session, however often it is
--     replayed, re-sent or redelivered;
--   * counted: tally deltas (prompt, gen, recomp, steps, engine seconds), account sums, worker sums.
-- The record is XADDed with its charges (`c`, built here: what a reader sees charged is what was
-- charged) unless no row of it is fresh. Then the acks (one XACK per input stream), input blobs to
-- delete, closures (a closed session's tally entry is folded into its session hash and removed),
-- dead letters, and the fused call's counters.
--
-- Tally entry (one field per session of KEYS[6]): att, pub, hw, prompt, gen, recomp, steps, es, t, gaps,
-- account, owed, packed with Redis' struct library as TALLY (schemas/accounting.py names the layout and
-- reads it; binary because this script decodes and re-encodes every session of every call, and JSON
-- cost twice as much). A new entry starts from the session hash (a session closed and opened again: a
-- route's replay; or a late answer) or empty.
-- Every key comes in KEYS; no key name is built here (Redis Cluster: one hash tag).
--
-- KEYS[1] worker hash, [2] billing accounts index set, [3] dead-letter stream, [4] lease, [5] lease
-- epoch, [6] tally, [7] call guard, [8..] the other keys, each once, referred to by index.
-- The layout is named once in Python (consumer/transport/publish.py: COMPLETE_ARGV); tests/test_lua.py
-- checks it against the lines below.
-- ARGV[1] group, [2] result_ttl_s, [3] result_maxlen, [4] dlq_maxlen, [5] reject_ttl_s,
-- [6] lease_token ('' : no lease check), [7] lease_epoch, [8] lease_ms, [9] act_ttl_s, [10] call_seq,
-- [11] control (JSON, below), then the records, their rows, blob bytes and dead letters the control
-- refers to by ARGV index.
-- control: {"records": [{"out": K, "r": A of the record (published as is), "c": A of its rows' columns the
--            script reads (JSON: sid, st, att, pos, frm, fed, tok, es), "acct": [n per row],
--            "skey": [K per row], "res": {"row": K}, "blob": {"row": [K, A]}}],
--           "accounts": [[K, "account id"], ...]  (acct number n >= 1 is accounts[n]; 0: none),
--           "acks": [[K, ["entry id", ...]], ...], "del": [K, ...],
--           "close": [["session id", K of its hash, "finished"|"cancelled"|"failed", acct n], ...],
--           "dead": A of the first dead letter (0: none), "nd": count,
--           "call": ["phase", sessions, rows, "engine seconds"] or absent}
-- Dead letter (3 + 2*nf ARGV): stream_k ('0': the cancel stream), entry_id, nf, then nf field/value pairs.
-- Returns: 'DUP', or the charges JSON of every record, in order.

local unpack = unpack or table.unpack
local group = ARGV[1]
local ttl = tonumber(ARGV[2])
local rmax = ARGV[3]
local dmax = ARGV[4]
local rttl = tonumber(ARGV[5])
local act_ttl = ARGV[9]
local now = tonumber(redis.call('TIME')[1])  -- the server's clock: one clock for every worker and the reaper
local ctl = cjson.decode(ARGV[11])
local worker, index, dlq, tally = KEYS[1], KEYS[2], KEYS[3], KEYS[6]

if ARGV[6] ~= '' and not hold_lease(KEYS[4], KEYS[5], ARGV[6], ARGV[7], ARGV[8]) then
  return redis.error_reply('DGRFENCED the lease of this worker is held by ' .. tostring(redis.call('GET', KEYS[4])))
end

-- The call guard (only with a lease: the epoch names this process).
if ARGV[6] ~= '' then
  local last = redis.call('GET', KEYS[7])
  if last then
    local e, q = string.match(last, '^(%d+) (%d+)$')
    if e == ARGV[7] and tonumber(q) >= tonumber(ARGV[10]) then
      return 'DUP'
    end
  end
  redis.call('SET', KEYS[7], ARGV[7] .. ' ' .. ARGV[10])
end

local function fmt(x)
  return string.format('%.17g', x)
end

local function int(x)
  return string.format('%d', x)
end

-- Stream id a is above stream id b ('ms-seq').
local function id_above(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if am == nil then return false end
  if bm == nil then return true end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end

local function expire_at_least(key, secs)
  if redis.call('TTL', key) < secs then
    redis.call('EXPIRE', key, secs)
  end
end

-- ---------------------------------------------------------------- the tally entries this call touches
-- An entry is the decoded array; what the script learns of it on the way lives in side tables keyed by
-- session id (so the array encodes back as it is).
local ATT, PUB, HW, PROMPT, GEN, RECOMP, STEPS, ES, T, GAPS, ACCOUNT, OWED = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
local TALLY = '<llllllldlHc0Hc0Hc0'  -- schemas/accounting.py: TALLY_LUA_FORMAT
local MAX_TEXT = 65535  -- a string of the entry (its uint16 length)
local L = {}        -- session id -> entry
local stored = {}   -- session id -> true: the entry is a field of the tally hash
local fresh_e = {}  -- session id -> true: made from nothing (everything before its first answer was lost)
local late = {}     -- session id -> true: its session hash is closed (see entry())
local dirty = {}    -- session id -> true: changed by this call
local sk = {}       -- session id -> KEYS index of its session hash
local ac = {}       -- session id -> its account number
local gl = {}       -- session id -> its gap list, once parsed
local ol = {}       -- session id -> its owed list, once parsed
do
  local want, seen = {}, {}
  for _, rec in ipairs(ctl.records) do
    local R = cjson.decode(ARGV[rec.c])
    rec.R = R
    local sid, acct = R.sid, rec.acct
    for i = 1, #sid do
      local s = sid[i]
      if acct[i] > 0 and not seen[s] then
        seen[s] = true
        want[#want + 1] = s
      end
    end
  end
  for _, c in ipairs(ctl.close or {}) do
    if not seen[c[1]] then
      seen[c[1]] = true
      want[#want + 1] = c[1]
    end
  end
  for j = 1, #want, 1000 do
    local part = {unpack(want, j, math.min(j + 999, #want))}
    local got = redis.call('HMGET', tally, unpack(part))
    for k, sid in ipairs(part) do
      local v = got[k]
      if v then
        local e = {struct.unpack(TALLY, v)}
        e[13] = nil  -- unpack's next position
        L[sid] = e
        stored[sid] = true
      end
    end
  end
end

-- A new entry: from the session hash when it exists. A hash already closed makes the entry *late* (an
-- answer filed after its session's closure, or a session opened again after it closed): its counts
-- go straight into the hash, so a closed session's hash and its account's sums stay equal.
local function entry(sid, skey)
  local e = {-1, -1, 0, 0, 0, 0, 0, 0, now, '-', '', '-'}
  local h = redis.call('HMGET', KEYS[skey], 'att', 'pub', 'hw', 'closed', 'gaps', 'owed')
  if h[3] then
    e[ATT], e[PUB], e[HW], e[GAPS] = tonumber(h[1]) or -1, tonumber(h[2]) or -1, tonumber(h[3]) or 0, h[5] or '-'
    e[OWED] = h[6] or '-'
  else
    fresh_e[sid] = true
  end
  if h[4] then
    late[sid] = true
  end
  L[sid] = e
  return e
end

-- Gaps: ok answers of the current attempt that may be missing from the surviving data set, as result
-- positions 'lo:hi,lo:hi' (inclusive), '-' for none. Redis losing the tail of its data loses a call's
-- tally update with its records; the worker goes on publishing newer answers, and a lost one it
-- re-sends later (when the Tracker re-pushes its job) is below `pub`: it is published when its position
-- is in a gap, which it then leaves. A gap opens when an answer's first position (`frm`) is above the
-- last published position (answers in between were lost), or below the first answer of a tally entry
-- made from nothing (everything before it was lost with the entry).
-- Owed: the same for charges. Positions below `hw` that no published answer charged, same format: an
-- answer whose first computed position is above `hw` leaves the positions in between owed (their
-- answers were lost with their charges); a later answer computing an owed position (the lost answer
-- re-sent, or a replay's prefill) charges it, and it leaves the list. Without data loss both are '-'.
local function ranges(text)
  local g = {}
  if text ~= '-' then
    for lo, hi in string.gmatch(text, '(%d+):(%d+)') do
      g[#g + 1] = {tonumber(lo), tonumber(hi)}
    end
  end
  return g
end

local function ranges_text(g)
  if #g == 0 then return '-' end
  local parts = {}
  for _, r in ipairs(g) do parts[#parts + 1] = string.format('%d:%d', r[1], r[2]) end
  local text = table.concat(parts, ',')
  -- Past MAX_TEXT (thousands of ranges: Redis lost data again and again) the oldest ranges are dropped:
  -- what they name is then neither re-published nor charged, never doubled.
  while #text > MAX_TEXT do
    table.remove(parts, 1)
    text = table.concat(parts, ',')
  end
  return text
end

local function gap_list(sid, e)
  local g = gl[sid]
  if g == nil then
    g = ranges(e[GAPS])
    gl[sid] = g
  end
  return g
end

local function add_gap(sid, e, lo, hi)
  if lo <= hi then
    local g = gap_list(sid, e)
    g[#g + 1] = {lo, hi}
  end
end

local function take_gap(sid, e, pos)  -- whether pos is in a gap; if so it leaves it
  if e[GAPS] == '-' and gl[sid] == nil then return false end
  local g = gap_list(sid, e)
  for j, r in ipairs(g) do
    if pos >= r[1] and pos <= r[2] then
      table.remove(g, j)
      add_gap(sid, e, r[1], pos - 1)
      add_gap(sid, e, pos + 1, r[2])
      return true
    end
  end
  return false
end

local function gaps_text(sid, e)
  local g = gl[sid]
  if g == nil then return e[GAPS] end
  return ranges_text(g)
end

local function owed_list(sid, e)
  local g = ol[sid]
  if g == nil then
    g = ranges(e[OWED])
    ol[sid] = g
  end
  return g
end

local function owe(sid, e, lo, hi)
  if lo <= hi then
    local g = owed_list(sid, e)
    g[#g + 1] = {lo, hi}
  end
end

-- How many of positions lo .. hi are owed; they are charged now, so they leave the list.
local function take_owed(sid, e, lo, hi)
  if lo > hi or (e[OWED] == '-' and ol[sid] == nil) then return 0 end
  local g = owed_list(sid, e)
  local keep, n = {}, 0
  for _, r in ipairs(g) do
    local a, b = math.max(r[1], lo), math.min(r[2], hi)
    if a <= b then
      n = n + b - a + 1
      if r[1] < a then keep[#keep + 1] = {r[1], a - 1} end
      if b < r[2] then keep[#keep + 1] = {b + 1, r[2]} end
    else
      keep[#keep + 1] = r
    end
  end
  ol[sid] = keep
  return n
end

local function owed_text(sid, e)
  local g = ol[sid]
  if g == nil then return e[OWED] end
  return ranges_text(g)
end

-- ---------------------------------------------------------------- rows
-- (The hot loop of the worker's hot path: columns held in locals, no string built per row unless the
-- row needs one, sums in locals. Lua 5.1 runs each operation in tens of nanoseconds.)
local accounts = {}  -- acct n -> {prompt, gen, recomp, steps, es}
local w_prompt, w_gen, w_recomp, w_steps, w_share, w_ok = 0, 0, 0, 0, 0.0, 0
local by_status = {}
local STATUS = {'cancelled', 'rejected', 'state_lost', 'failed'}
local out = {}
local n_rows, n_fresh = 0, 0

for ri, rec in ipairs(ctl.records) do
  local R = rec.R
  local Rsid, Rst, Rpos, Ratt, Rfrm, Rfed, Rtok, Res = R.sid, R.st, R.pos, R.att, R.frm, R.fed, R.tok, R.es
  local acct, skey, res, blob = rec.acct, rec.skey, rec.res, rec.blob
  local has_blob = next(blob) ~= nil
  local n = #Rsid
  local P, G, RC, D = {}, {}, {}, {}
  local any_acct, published = false, 0
  for i = 1, n do
    local st, pos, a = Rst[i], Rpos[i], acct[i]
    local sid = Rsid[i]
    local e = nil
    if a > 0 then
      e = L[sid]
      if e == nil then
        e = entry(sid, skey[i])
      end
      sk[sid], ac[sid] = skey[i], a
    end
    local fresh
    if st == 0 and e ~= nil then
      local att, eatt = Ratt[i], e[ATT]
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
    local p, g, rc = 0, 0, 0
    if fresh then
      published = published + 1
      local es = Res[i]
      if e ~= nil then
        local fed, hw, tok = Rfed[i], e[HW], Rtok[i] >= 0
        if fed > pos then fed = pos end
        -- the first position the row computed: above hw, the ones in between are owed (lost answers)
        local lo = fed > 0 and pos - fed or (tok and pos or -1)
        if lo > hw then owe(sid, e, hw, lo - 1) end
        if fed > 0 then
          local from = pos - fed
          if from < hw then
            p = take_owed(sid, e, from, math.min(pos, hw) - 1)
            from = hw
          end
          if pos > from then p = p + pos - from end
          rc = fed - p
          if pos > hw then hw = pos end
        end
        if tok then
          if pos >= hw then
            g = 1
            hw = pos + 1
          elseif take_owed(sid, e, pos, pos) == 1 then
            g = 1
          else
            rc = rc + 1
          end
        end
        e[HW] = hw
        e[PROMPT], e[GEN], e[RECOMP], e[STEPS], e[ES] = e[PROMPT] + p, e[GEN] + g, e[RECOMP] + rc, e[STEPS] + 1,
          e[ES] + es
        dirty[sid] = true
        local s = accounts[a]
        if s == nil then
          s = {0, 0, 0, 0, 0.0}
          accounts[a] = s
        end
        s[1], s[2], s[3], s[4], s[5] = s[1] + p, s[2] + g, s[3] + rc, s[4] + 1, s[5] + es
        any_acct = true
      end
      w_prompt, w_gen, w_recomp, w_steps, w_share = w_prompt + p, w_gen + g, w_recomp + rc, w_steps + 1, w_share + es
      if st == 0 then
        w_ok = w_ok + 1
      else
        local name = STATUS[st]
        by_status[name] = (by_status[name] or 0) + 1
      end
      if has_blob then
        local b = blob[tostring(i - 1)]
        if b ~= nil then
          redis.call('SET', KEYS[b[1]], ARGV[b[2]], 'EX', act_ttl)
        end
      end
    else
      D[#D + 1] = i - 1
    end
    P[i], G[i], RC[i] = p, g, rc
  end
  n_rows, n_fresh = n_rows + n, n_fresh + published
  local charges = '{"p":[' .. table.concat(P, ',') .. '],"g":[' .. table.concat(G, ',') .. '],"r":[' ..
    table.concat(RC, ',') .. '],"d":[' .. table.concat(D, ',') .. ']}'
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
  if L[sid] ~= nil then
    closing[sid] = c[3]
    sk[sid] = c[2]
    if c[4] > 0 then ac[sid] = c[4] end
  elseif redis.call('EXISTS', KEYS[c[2]]) == 1 then
    redis.call('HSETNX', KEYS[c[2]], 'closed', c[3])  -- nothing charged since it closed: mark it, create nothing
  end
end
do
  local pairs_ = {}
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
      pairs_[#pairs_ + 1] = sid
      local g, o = gaps_text(sid, e), owed_text(sid, e)
      pairs_[#pairs_ + 1] = struct.pack(TALLY, e[ATT], e[PUB], e[HW], e[PROMPT], e[GEN], e[RECOMP], e[STEPS],
        e[ES], now, #g, g, #account, account, #o, o)
      if #pairs_ >= 2000 then
        redis.call('HSET', tally, unpack(pairs_))
        pairs_ = {}
      end
    end
  end
  if #pairs_ > 0 then
    redis.call('HSET', tally, unpack(pairs_))
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
  redis.call('HINCRBYFLOAT', worker, 'engine_seconds_share', fmt(w_share))
  for status, k in pairs(by_status) do
    redis.call('HINCRBY', worker, 'results:' .. status, int(k))
  end
end

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
