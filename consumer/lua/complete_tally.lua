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
local moved = {}    -- session id -> the attempt the Tracker moved off this worker (KEYS[8]): fenced rows
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
  local any_moved = #want > 0 and redis.call('EXISTS', KEYS[8]) == 1  -- one lookup per call when none moved
  for j = 1, #want, 1000 do
    local part = {unpack(want, j, math.min(j + 999, #want))}
    local got = redis.call('HMGET', tally, unpack(part))
    if any_moved then
      local mv = redis.call('HMGET', KEYS[8], unpack(part))
      for k, sid in ipairs(part) do
        if mv[k] then moved[sid] = tonumber(mv[k]) end
      end
    end
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

-- A session's range list of field `f` of its entry e (gaps or owed positions), parsed once per call into
-- `cache` (gl or ol); `add_range` appends lo .. hi to it.
local function range_list(cache, f, sid, e)
  local g = cache[sid]
  if g == nil then
    g = ranges(e[f])
    cache[sid] = g
  end
  return g
end

local function add_range(cache, f, sid, e, lo, hi)
  if lo <= hi then
    local g = range_list(cache, f, sid, e)
    g[#g + 1] = {lo, hi}
  end
end

local function gap_list(sid, e) return range_list(gl, GAPS, sid, e) end
local function add_gap(sid, e, lo, hi) add_range(gl, GAPS, sid, e, lo, hi) end

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

-- What field f of the session's entry becomes: as it was when the call never parsed it.
local function range_text(cache, f, sid, e)
  local g = cache[sid]
  if g == nil then return e[f] end
  return ranges_text(g)
end

local function gaps_text(sid, e) return range_text(gl, GAPS, sid, e) end

local function owed_list(sid, e) return range_list(ol, OWED, sid, e) end
local function owe(sid, e, lo, hi) add_range(ol, OWED, sid, e, lo, hi) end

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

local function owed_text(sid, e) return range_text(ol, OWED, sid, e) end
