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
--     above the last ok answer published for the session), a row that is not ok by `SET NX` of its
--     result id's marker (`res` key). A row that is not fresh is neither published nor charged: its
--     index goes to the charges' `d` list;
--   * charged (rows with a billing account): prompt positions fed (`fed`, the positions pos - fed ..
--     pos - 1) above the session's charged high-water mark `hw`, the rest recomputed; a sampled token
--     at position pos >= hw; then hw moves past them. So every prompt position and every sampled
--     token is charged once per session, however often it is replayed, re-sent or redelivered;
--   * counted: tally deltas (prompt, gen, recomp, steps, engine seconds), account sums, worker sums.
-- The record is XADDed with its charges (`c`, built here: what a reader sees charged is what was
-- charged) unless no row of it is fresh. Then the acks (one XACK per input stream), input blobs to
-- delete, closures (a closed session's tally entry is folded into its session hash and removed),
-- dead letters, and the fused call's counters.
--
-- Tally entry (one field per session of KEYS[6]): 'att pub hw prompt gen recomp steps es t gaps account'. A new
-- entry starts from the session hash (a session closed and opened again: a route's replay) or empty.
-- Every key comes in KEYS; no key name is built here (Redis Cluster: one hash tag).
--
-- KEYS[1] worker hash, [2] billing accounts index set, [3] dead-letter stream, [4] lease, [5] lease
-- epoch, [6] tally, [7] call guard, [8..] the other keys, each once, referred to by index.
-- The layout is named once in Python (consumer/transport/publish.py: COMPLETE_ARGV); tests/test_lua.py
-- checks it against the lines below.
-- ARGV[1] group, [2] result_ttl_s, [3] result_maxlen, [4] dlq_maxlen, [5] reject_ttl_s,
-- [6] lease_token ('' : no lease check), [7] lease_epoch, [8] lease_ms, [9] act_ttl_s, [10] call_seq,
-- [11] control (JSON, below), then the records, blob bytes and dead letters the control refers to by
-- ARGV index.
-- control: {"records": [{"out": K, "r": A, "acct": [n per row], "skey": [K per row], "res": {"row": K},
--            "past": {"row": end position of a job refused as a duplicate}, "blob": {"row": [K, A]}}],
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
local now = redis.call('TIME')[1]  -- the server's clock: one clock for every worker and the reaper
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
local L = {}  -- session id -> entry table (loaded or new)
do
  local want, seen = {}, {}
  for _, rec in ipairs(ctl.records) do
    local R = cjson.decode(ARGV[rec.r])
    rec.R = R
    for i = 1, #R.sid do
      if rec.acct[i] > 0 and not seen[R.sid[i]] then
        seen[R.sid[i]] = true
        want[#want + 1] = R.sid[i]
      end
    end
  end
  for _, c in ipairs(ctl.close or {}) do
    if not seen[c[1]] then
      seen[c[1]] = true
      want[#want + 1] = c[1]
    end
  end
  if #want > 0 then
    local got = redis.call('HMGET', tally, unpack(want))
    for j, sid in ipairs(want) do
      local v = got[j]
      if v then
        local a, p, h, pr, g, rc, st, es, t, gaps = string.match(v,
          '^(%-?%d+) (%-?%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%S+) (%S+) (%S+) ')
        L[sid] = {att = tonumber(a), pub = tonumber(p), hw = tonumber(h), prompt = tonumber(pr), gen = tonumber(g),
                  recomp = tonumber(rc), steps = tonumber(st), es = tonumber(es), t = t, gaps = gaps, stored = true}
      end
    end
  end
end

-- A new entry: from the session hash when it exists. A hash already closed makes the entry *late* (an
-- answer filed after its session's closure, or a session opened again after it closed): its counts
-- go straight into the hash, so a closed session's hash and its account's sums stay equal.
local function entry(sid, skey, a)
  local e = L[sid]
  if e == nil then
    e = {att = -1, pub = -1, hw = 0, prompt = 0, gen = 0, recomp = 0, steps = 0, es = 0.0, t = now, gaps = '-',
         new = true}
    local h = redis.call('HMGET', KEYS[skey], 'att', 'pub', 'hw', 'closed', 'gaps')
    if h[3] then
      e.att, e.pub, e.hw, e.gaps, e.new = tonumber(h[1]) or -1, tonumber(h[2]) or -1, tonumber(h[3]) or 0,
        h[5] or '-', false
    end
    e.late = h[4] ~= false and h[4] ~= nil
    L[sid] = e
  end
  e.skey, e.acct = skey, a
  return e
end

-- Gaps: ok answers of the current attempt that may be missing from the surviving data set, as result
-- positions 'lo:hi,lo:hi' (inclusive), '-' for none. Redis losing the tail of its data loses a call's
-- tally update with its records; the worker goes on publishing newer answers, and a lost one it
-- re-sends later (when the Tracker re-pushes its job) is below `pub`: it is published when its position
-- is in a gap, which it then leaves. A gap opens when an answer's first position (`frm`) is above the
-- last published position (answers in between were lost), or below the first answer of a tally entry
-- made from nothing (`new`: everything before it was lost with the entry).
local function gap_list(e)
  if e.gl == nil then
    e.gl = {}
    if e.gaps ~= '-' then
      for lo, hi in string.gmatch(e.gaps, '(%d+):(%d+)') do
        e.gl[#e.gl + 1] = {tonumber(lo), tonumber(hi)}
      end
    end
  end
  return e.gl
end

local function add_gap(e, lo, hi)
  if lo <= hi then
    local gl = gap_list(e)
    gl[#gl + 1] = {lo, hi}
  end
end

local function take_gap(e, pos)  -- whether pos is in a gap; if so it leaves it
  if e.gaps == '-' and e.gl == nil then return false end
  local gl = gap_list(e)
  for j, g in ipairs(gl) do
    if pos >= g[1] and pos <= g[2] then
      table.remove(gl, j)
      add_gap(e, g[1], pos - 1)
      add_gap(e, pos + 1, g[2])
      return true
    end
  end
  return false
end

local function gaps_text(e)
  if e.gl == nil then return e.gaps end
  if #e.gl == 0 then return '-' end
  local parts = {}
  for _, g in ipairs(e.gl) do parts[#parts + 1] = string.format('%d:%d', g[1], g[2]) end
  return table.concat(parts, ',')
end

-- ---------------------------------------------------------------- rows
local accounts = {}  -- acct n -> sums
local w = {prompt = 0, gen = 0, recomp = 0, steps = 0, share = 0.0}
local by_status = {}
local STATUS = {[0] = 'ok', 'cancelled', 'rejected', 'state_lost', 'failed'}
local out = {}
local n_rows, n_fresh = 0, 0

for ri, rec in ipairs(ctl.records) do
  local R = rec.R
  local n = #R.sid
  local P, G, RC, D = {}, {}, {}, {}
  local any_acct, published = false, 0
  for i = 1, n do
    local sid, st, pos, a = R.sid[i], R.st[i], R.pos[i], rec.acct[i]
    local e = nil
    if a > 0 then
      e = entry(sid, rec.skey[i], a)
    end
    local fresh
    if st == 0 and e ~= nil then
      local att, frm = R.att[i], R.frm[i]
      if att > e.att or (att == e.att and pos > e.pub) then
        fresh = true
        if att > e.att then  -- a newer attempt starts afresh (a replay's first answer starts at position 0)
          e.gl = {}
          add_gap(e, 1, frm)
        elseif e.new then
          add_gap(e, 1, frm)  -- a result's position is at least 1: every answer computed a position
        else
          add_gap(e, e.pub + 1, frm)
        end
        e.att, e.pub, e.new = att, pos, false
      else
        fresh = att == e.att and take_gap(e, pos)
      end
    elseif st == 0 then
      fresh = true
    else
      local row = tostring(i - 1)
      local past = rec.past[row]
      if past ~= nil and e ~= nil and R.att[i] == e.att and e.pub >= past then
        fresh = false  -- a job refused as a duplicate whose positions were answered already
      else
        fresh = redis.call('SET', KEYS[rec.res[row]], '1', 'NX', 'EX', a > 0 and ttl or rttl) ~= false
      end
    end
    local p, g, rc = 0, 0, 0
    n_rows = n_rows + 1
    if fresh then
      n_fresh = n_fresh + 1
      published = published + 1
      if e ~= nil then
        local fed = math.min(R.fed[i], pos)
        if fed > 0 then
          local from = math.max(pos - fed, e.hw)
          p = math.max(0, pos - from)
          rc = fed - p
          if pos > e.hw then
            e.hw = pos
          end
        end
        if R.tok[i] >= 0 then
          if pos >= e.hw then
            g = 1
            e.hw = pos + 1
          else
            rc = rc + 1
          end
        end
        local es = R.es[i]
        e.prompt, e.gen, e.recomp, e.steps, e.es = e.prompt + p, e.gen + g, e.recomp + rc, e.steps + 1, e.es + es
        e.t, e.dirty = now, true
        local s = accounts[a]
        if s == nil then
          s = {prompt = 0, gen = 0, recomp = 0, steps = 0, es = 0.0}
          accounts[a] = s
        end
        s.prompt, s.gen, s.recomp, s.steps, s.es = s.prompt + p, s.gen + g, s.recomp + rc, s.steps + 1, s.es + es
        any_acct = true
      end
      w.prompt, w.gen, w.recomp, w.steps, w.share = w.prompt + p, w.gen + g, w.recomp + rc, w.steps + 1,
        w.share + R.es[i]
      local name = STATUS[st]
      by_status[name] = (by_status[name] or 0) + 1
      local b = rec.blob[tostring(i - 1)]
      if b ~= nil then
        redis.call('SET', KEYS[b[1]], ARGV[b[2]], 'EX', act_ttl)
      end
    else
      D[#D + 1] = i - 1
    end
    P[i], G[i], RC[i] = p, g, rc
  end
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

-- ---------------------------------------------------------------- acks, input blobs
for _, a in ipairs(ctl.acks or {}) do
  redis.call('XACK', KEYS[a[1]], group, unpack(a[2]))
end
for _, k in ipairs(ctl.del or {}) do
  redis.call('DEL', KEYS[k])
end

-- ---------------------------------------------------------------- closures, the tally
local acct_ids = ctl.accounts or {}
for _, c in ipairs(ctl.close or {}) do
  local e = L[c[1]]
  if e ~= nil then
    e.closing, e.skey = c[3], c[2]
    if c[4] > 0 then e.acct = c[4] end
  elseif redis.call('EXISTS', KEYS[c[2]]) == 1 then
    redis.call('HSETNX', KEYS[c[2]], 'closed', c[3])  -- nothing charged since it closed: mark it, create nothing
  end
end
do
  local pairs_ = {}
  for sid, e in pairs(L) do
    if e.closing or e.late then
      -- Folded into the session hash: a closing session's entry, or a late one (see entry()).
      if e.dirty or e.closing then
        local hk = KEYS[e.skey]
        redis.call('HINCRBY', hk, 'prompt_tokens', int(e.prompt))
        redis.call('HINCRBY', hk, 'generated_tokens', int(e.gen))
        redis.call('HINCRBY', hk, 'recomputed_tokens', int(e.recomp))
        redis.call('HINCRBY', hk, 'steps', int(e.steps))
        redis.call('HINCRBYFLOAT', hk, 'engine_seconds', fmt(e.es))
        redis.call('HSET', hk, 'att', int(e.att), 'pub', int(e.pub), 'hw', int(e.hw), 'gaps', gaps_text(e))
        if e.acct ~= nil and e.acct > 0 then
          redis.call('HSET', hk, 'account', acct_ids[e.acct][2])
        end
        if e.closing then
          redis.call('HSETNX', hk, 'closed', e.closing)
        end
        redis.call('EXPIRE', hk, ttl)
      end
      if e.stored then
        redis.call('HDEL', tally, sid)
      end
    elseif e.dirty then
      pairs_[#pairs_ + 1] = sid
      pairs_[#pairs_ + 1] = int(e.att) .. ' ' .. int(e.pub) .. ' ' .. int(e.hw) .. ' ' .. int(e.prompt) .. ' ' ..
        int(e.gen) .. ' ' .. int(e.recomp) .. ' ' .. int(e.steps) .. ' ' .. fmt(e.es) .. ' ' .. e.t .. ' ' ..
        gaps_text(e) .. ' ' .. ((e.acct or 0) > 0 and acct_ids[e.acct][2] or '')
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
  redis.call('HINCRBY', key, 'prompt_tokens', int(s.prompt))
  redis.call('HINCRBY', key, 'generated_tokens', int(s.gen))
  redis.call('HINCRBY', key, 'steps', int(s.steps))
  if s.recomp > 0 then
    redis.call('HINCRBY', key, 'recomputed_tokens', int(s.recomp))
  end
  redis.call('HINCRBYFLOAT', key, 'engine_seconds', fmt(s.es))
  redis.call('SADD', index, acct_ids[n][2])
end
if w.steps > 0 then
  redis.call('HINCRBY', worker, 'steps', int(w.steps))
  redis.call('HINCRBY', worker, 'prompt_tokens', int(w.prompt))
  redis.call('HINCRBY', worker, 'generated_tokens', int(w.gen))
  if w.recomp > 0 then
    redis.call('HINCRBY', worker, 'recomputed_tokens', int(w.recomp))
  end
  redis.call('HINCRBYFLOAT', worker, 'engine_seconds_share', fmt(w.share))
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
