-- The tenants' limits on Redis (dispatcher/store/limits_redis.py): one tenant's state under
-- KEYS[1], a base key holding the tenant's hash tag ("<prefix>{<tenant>}"); every key the
-- scripts touch is that base and a suffix, so one tenant's keys share a cluster slot.
--
-- ARGV[1], ARGV[2]: the monotonic and wall clocks as decimal strings, or both empty: the
-- server's TIME (the default; an injected clock is the tests' seam). ARGV[3]: the operation,
-- the rest its arguments. Every answer is one string, its fields separated by spaces (no
-- field holds one; a field may be empty), and ends with the tenant's snapshot (in flight,
-- then the day and month spent). Numbers are written "%d" (integers) or "%.17g" (the same
-- doubles as Python's).
--
-- The semantics are dispatcher/store/limits.py's LimitCounters (the reference), with one
-- addition: a place in flight is a lease (ZSET "fly", scored by its expiry), so the holds of
-- an edge that died come back, and what they reserved with them.

local base = KEYS[1]
local K_ST = base .. ':st'      -- hash: charged, rsv_tokens, rsv_usd, day, day_tokens, ...
local K_REQ = base .. ':req'    -- zset: request id -> admitted at (the rpm window)
local K_CHG = base .. ':chg'    -- zset: request id -> charged at (the tpm window, live charges)
local K_TOK = base .. ':tok'    -- hash: request id -> its live charge's tokens
local K_FLY = base .. ':fly'    -- zset: request id -> its lease's expiry (max_concurrent)
local WINDOW = 60
local KEEP = 40 * 86400         -- a tenant's keys outlive a month of idleness, no longer
local KEEP_EVERY = 3600         -- an admission renews the keys' expiry at most this often
local HOLD_KEEP = 86400         -- a request's hold answers its settles for a day

local fmt = string.format
local function f(x) return fmt('%.17g', x) end
local function int(x) return fmt('%d', x) end
local function num(s) return tonumber(s) or 0 end

local now, wall
if ARGV[1] ~= '' then
  now, wall = tonumber(ARGV[1]), tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  wall = now
end
-- The clocks as the answers and the scores write them (each formatted once).
local NOW = f(now)
local WALL = NOW
if wall ~= now then WALL = f(wall) end

-- The UTC date of a day count since the epoch (Howard Hinnant's civil_from_days).
local function civil(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m
  if mp < 10 then m = mp + 3 else m = mp - 9 end
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local P_DAYS, P_DAY, P_MONTH  -- the last day's periods (a call asks for one day or two)
local function periods(at)
  local days = math.floor(at / 86400)
  if days ~= P_DAYS then
    local y, m, d = civil(days)
    P_DAYS, P_DAY, P_MONTH = days, fmt('%04d-%02d-%02d', y, m, d), fmt('%04d-%02d', y, m)
  end
  return P_DAY, P_MONTH
end

local function hold_key(rid) return base .. ':hold:' .. rid end

-- The tenant's hash, read once per call into S and written back once (its fields that
-- changed): one HMGET and at most one HSET, where each field's own command would cost a call
-- apiece. (An absent field reads as 0 or ''.) Tables are built whole by their constructors,
-- and no loop runs over the field names: the script's own work costs as much as the calls.
local S, L  -- the state, and the state as loaded
local changed = false
local function load()
  local v = redis.call('HMGET', K_ST, 'day', 'day_tokens', 'day_usd', 'month', 'month_tokens',
    'month_usd', 'rsv_tokens', 'rsv_usd', 'charged', 'kept')
  S = {day = v[1] or '', day_tokens = num(v[2]), day_usd = num(v[3]), month = v[4] or '',
    month_tokens = num(v[5]), month_usd = num(v[6]), rsv_tokens = num(v[7]),
    rsv_usd = num(v[8]), charged = num(v[9]), kept = num(v[10])}
  L = {day = S.day, day_tokens = S.day_tokens, day_usd = S.day_usd, month = S.month,
    month_tokens = S.month_tokens, month_usd = S.month_usd, rsv_tokens = S.rsv_tokens,
    rsv_usd = S.rsv_usd, charged = S.charged, kept = S.kept}
end
-- The spent fields as save() wrote them (answer() writes them the same).
local W_DAY_TOKENS, W_DAY_USD, W_MONTH_TOKENS, W_MONTH_USD
local function save()
  if not changed then return end
  local out, n = {}, 0
  if S.day ~= L.day then out[n + 1], out[n + 2], n = 'day', S.day, n + 2 end
  if S.day_tokens ~= L.day_tokens then
    W_DAY_TOKENS = int(S.day_tokens)
    out[n + 1], out[n + 2], n = 'day_tokens', W_DAY_TOKENS, n + 2
  end
  if S.day_usd ~= L.day_usd then
    W_DAY_USD = f(S.day_usd)
    out[n + 1], out[n + 2], n = 'day_usd', W_DAY_USD, n + 2
  end
  if S.month ~= L.month then out[n + 1], out[n + 2], n = 'month', S.month, n + 2 end
  if S.month_tokens ~= L.month_tokens then
    W_MONTH_TOKENS = int(S.month_tokens)
    out[n + 1], out[n + 2], n = 'month_tokens', W_MONTH_TOKENS, n + 2
  end
  if S.month_usd ~= L.month_usd then
    W_MONTH_USD = f(S.month_usd)
    out[n + 1], out[n + 2], n = 'month_usd', W_MONTH_USD, n + 2
  end
  if S.rsv_tokens ~= L.rsv_tokens then
    out[n + 1], out[n + 2], n = 'rsv_tokens', int(S.rsv_tokens), n + 2
  end
  if S.rsv_usd ~= L.rsv_usd then out[n + 1], out[n + 2], n = 'rsv_usd', f(S.rsv_usd), n + 2 end
  if S.charged ~= L.charged then out[n + 1], out[n + 2], n = 'charged', int(S.charged), n + 2 end
  if S.kept ~= L.kept then out[n + 1], out[n + 2], n = 'kept', f(S.kept), n + 2 end
  if n > 0 then redis.call('HSET', K_ST, unpack(out)) end
end

-- A hold's reservation (its fields reserved, tokens, usd) comes off the tenant's total;
-- true if it was still reserved (the caller marks the hold so).
local function unreserve(reserved, tokens, usd)
  if reserved ~= '1' then return false end
  S.rsv_tokens = S.rsv_tokens - num(tokens)
  S.rsv_usd = S.rsv_usd - num(usd)
  changed = true
  return true
end

-- A live charge (still in the tpm window) becomes `tokens`; the caller sets the hold's charge.
local function recharge(rid, tokens)
  local old = redis.call('HGET', K_TOK, rid)
  if old then
    S.charged = S.charged + tokens - num(old)
    changed = true
    redis.call('HSET', K_TOK, rid, tokens)
  end
end

local function roll(day, month)
  if day > S.day then S.day, S.day_tokens, S.day_usd = day, 0, 0; changed = true end
  if month > S.month then S.month, S.month_tokens, S.month_usd = month, 0, 0; changed = true end
end

local function spend(tokens, usd, at)
  local day, month = periods(at)
  roll(day, month)
  if S.day == day then  -- spend of an earlier period counts in it no more
    S.day_tokens, S.day_usd = S.day_tokens + tokens, S.day_usd + usd
  end
  if S.month == month then
    S.month_tokens, S.month_usd = S.month_tokens + tokens, S.month_usd + usd
  end
  changed = true
end

-- The windows move on, leases run out: what an admission (or a read) decides on. Answers
-- the places in flight, the requests in the window and the oldest one left in it (its id and
-- score; nil when the window is empty). (A settle or a release needs none of it: what it
-- changes is the same whether the windows moved first or not.) The two windows hold the same
-- ids at the same times (an admission adds to both, both drop what is older than the
-- window): while the oldest request is in the window, neither has anything to drop; when
-- it alone left (one client's steady state), it is all they drop.
local function advance()
  local cutoff = now - WINDOW
  local head = redis.call('ZRANGE', K_REQ, 0, 1, 'WITHSCORES')
  local first_id, first_at, known = head[1], head[2], true
  local gone = nil
  if head[2] and tonumber(head[2]) <= cutoff then
    if not head[4] or tonumber(head[4]) > cutoff then
      gone = {head[1]}
      redis.call('ZREM', K_REQ, head[1])
      first_id, first_at = head[3], head[4]
    else
      local c = f(cutoff)
      redis.call('ZREMRANGEBYSCORE', K_REQ, '-inf', c)
      gone = redis.call('ZRANGEBYSCORE', K_CHG, '-inf', c)
      known = false
    end
    if #gone > 0 then
      local sum = 0
      for _, t in ipairs(redis.call('HMGET', K_TOK, unpack(gone))) do sum = sum + num(t) end
      S.charged = S.charged - sum
      redis.call('ZREM', K_CHG, unpack(gone))
      redis.call('HDEL', K_TOK, unpack(gone))
      changed = true
    end
  end
  local requests = redis.call('ZCARD', K_REQ)
  if gone and #gone > 0 and requests == 0 then
    S.charged = 0  -- (the charges' window is empty)
  end
  if not known then
    head = redis.call('ZRANGE', K_REQ, 0, 0, 'WITHSCORES')
    first_id, first_at = head[1], head[2]
  end
  -- Leases run out: the holds of an edge that died (or never released them) come back.
  local expired = redis.call('ZRANGEBYSCORE', K_FLY, '-inf', NOW)
  if #expired > 0 then
    for _, rid in ipairs(expired) do
      local hk = hold_key(rid)
      local h = redis.call('HMGET', hk, 'reserved', 'tokens', 'usd')
      if h[2] then  -- the hold is known (kept HOLD_KEEP)
        unreserve(h[1], h[2], h[3])
        redis.call('HSET', hk, 'reserved', '0', 'released', '1')
      end
    end
    redis.call('ZREMRANGEBYSCORE', K_FLY, '-inf', NOW)
  end
  local flying = redis.call('ZCARD', K_FLY)
  if flying == 0 and (S.rsv_tokens ~= 0 or S.rsv_usd ~= 0) then
    S.rsv_tokens, S.rsv_usd = 0, 0  -- nothing in flight reserves anything
    changed = true
  end
  roll(periods(wall))
  return flying, requests, first_id, first_at
end

local function keep()
  redis.call('EXPIRE', K_ST, KEEP)
  redis.call('EXPIRE', K_REQ, KEEP)
  redis.call('EXPIRE', K_CHG, KEEP)
  redis.call('EXPIRE', K_TOK, KEEP)
  redis.call('EXPIRE', K_FLY, KEEP)
  S.kept = wall
  changed = true
end

-- Every answer: the clocks, the operation's own head (its fields joined), then the tenant's
-- snapshot (in flight, the day and month spent). `flying` is the places in flight if the
-- caller knows them.
local function answer(head, flying)
  save()
  if not flying then flying = redis.call('ZCOUNT', K_FLY, '(' .. NOW, '+inf') end
  return NOW .. ' ' .. WALL .. ' ' .. head .. ' ' .. tostring(flying) .. ' ' .. S.day .. ' '
    .. (W_DAY_TOKENS or int(S.day_tokens)) .. ' ' .. (W_DAY_USD or f(S.day_usd)) .. ' '
    .. S.month .. ' ' .. (W_MONTH_TOKENS or int(S.month_tokens)) .. ' '
    .. (W_MONTH_USD or f(S.month_usd))
end

-- What the x-ratelimit headers need, after an admission's head: requests in the window
-- (`requests`) and the oldest one's time, tokens charged and the oldest charge's time -- the
-- same time: the two windows hold the same ids at the same times. `oldest`: the oldest
-- request's score (advance's, or the one just admitted if earlier). Left empty for a key with
-- neither rpm nor tpm (no such headers).
local function with_headers(head, requests, oldest)
  if ARGV[8] == '' and ARGV[9] == '' then oldest = '' end
  return head .. ' ' .. tostring(requests) .. ' ' .. oldest .. ' ' .. int(S.charged) .. ' '
    .. oldest
end

local op = ARGV[3]
load()

-- A request's attempt settles once (keyed by the request and the attempt, on any edge): its
-- live charge becomes what it used, its reservation comes off, what it spent counts.
local function settle(rid, attempt, tokens, usd)
  local hk = hold_key(rid)
  if redis.call('HSETNX', hk, 's:' .. attempt, '1') == 0 then
    return 'again'  -- this (request, attempt) settled before
  end
  redis.call('EXPIRE', hk, HOLD_KEEP)
  local h = redis.call('HMGET', hk, 'settled', 'charge', 'tokens', 'reserved', 'usd')
  if h[3] then  -- the hold is known (else only the spend counts)
    local charge = tokens
    if num(h[1]) > 0 then charge = tokens + num(h[2]) end
    recharge(rid, charge)
    unreserve(h[4], h[3], h[5])
    redis.call('HSET', hk, 'charge', charge, 'settled', num(h[1]) + 1, 'reserved', '0')
  end
  spend(tokens, usd, wall)
  return 'settled'
end

-- A request leaves (once): its place in flight and what it still reserved come back; one
-- not answered and never settled costs nothing.
local function release(rid, answered)
  local hk = hold_key(rid)
  local h = redis.call('HMGET', hk, 'released', 'settled', 'reserved', 'tokens', 'usd')
  if h[1] ~= '0' then return 'again' end  -- released before, or unknown
  redis.call('ZREM', K_FLY, rid)
  unreserve(h[3], h[4], h[5])
  if num(h[2]) == 0 and answered ~= '1' then  -- it costs nothing
    recharge(rid, 0)
    redis.call('HSET', hk, 'released', '1', 'reserved', '0', 'charge', 0)
  else
    redis.call('HSET', hk, 'released', '1', 'reserved', '0')
  end
  return 'released'
end

-- A settle and its request's release, posted one after the other: settle() then release(),
-- with the hold read once and written once. Answers the release's outcome.
local function finish(rid, attempt, tokens, usd, answered)
  local hk = hold_key(rid)
  local mark = 's:' .. attempt
  local h = redis.call('HMGET', hk, mark, 'settled', 'charge', 'tokens', 'reserved', 'usd',
    'released')
  local settled, reserved = num(h[2]), h[5]
  local out, n = {}, 0  -- the hold's fields to write
  if not h[1] then  -- the settle: this (request, attempt) did not settle before
    out[1], out[2], n = mark, '1', 2
    if h[4] then  -- the hold is known (else only the spend counts)
      local charge = tokens
      if settled > 0 then charge = tokens + num(h[3]) end
      recharge(rid, charge)
      unreserve(reserved, h[4], h[6])
      settled, reserved = settled + 1, '0'
      out[3], out[4], out[5], out[6], out[7], out[8], n =
        'charge', charge, 'settled', settled, 'reserved', '0', 8
    end
    spend(tokens, usd, wall)
  end
  local outcome = 'again'  -- the release: released before, or unknown
  if h[7] == '0' then
    outcome = 'released'
    redis.call('ZREM', K_FLY, rid)
    unreserve(reserved, h[4], h[6])
    out[n + 1], out[n + 2], out[n + 3], out[n + 4], n = 'released', '1', 'reserved', '0', n + 4
    if settled == 0 and answered ~= '1' then  -- it costs nothing
      recharge(rid, 0)
      out[n + 1], out[n + 2], n = 'charge', 0, n + 2
    end
  end
  if n > 0 then redis.call('HSET', hk, unpack(out)) end
  if not h[1] then redis.call('EXPIRE', hk, HOLD_KEEP) end
  return outcome
end

if op == 'admit' then
  -- A write of this edge's posted just before (its request's settle and release, or its
  -- release) may ride along: it runs first, as it would have in a script of its own.
  local carried = ARGV[15]
  if carried == 'finish' then
    finish(ARGV[16], ARGV[17], tonumber(ARGV[18]), tonumber(ARGV[19]), ARGV[20])
  elseif carried == 'release' then
    release(ARGV[16], ARGV[17])
  end
  local flying, n, first_id, first_at = advance()
  -- A tenant's keys are kept KEEP past its last admission or spend (within KEEP_EVERY: an
  -- admission renews them all only that often, and gives a key it creates its expiry):
  -- what else comes (a settle, a release, a renewal) follows an admission by at most
  -- HOLD_KEEP.
  if not (S.kept <= wall and wall < S.kept + KEEP_EVERY) then keep() end
  local rid, tokens, usd, lease = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local rpm, tpm, conc = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  -- The first limit reached refuses: the budgets (in this order), then the places in flight,
  -- the minute's requests, its tokens. (limit, value, Retry-After)
  local limit, value, retry
  local cap = tonumber(ARGV[11])
  if cap and S.day_tokens + S.rsv_tokens >= cap then
    limit, value, retry = 'budget_tokens_day', f(S.day_tokens + S.rsv_tokens), '0'
  end
  cap = tonumber(ARGV[12])
  if not limit and cap and S.day_usd + S.rsv_usd >= cap then
    limit, value, retry = 'budget_usd_day', f(S.day_usd + S.rsv_usd), '0'
  end
  cap = tonumber(ARGV[13])
  if not limit and cap and S.month_tokens + S.rsv_tokens >= cap then
    limit, value, retry = 'budget_tokens_month', f(S.month_tokens + S.rsv_tokens), '0'
  end
  cap = tonumber(ARGV[14])
  if not limit and cap and S.month_usd + S.rsv_usd >= cap then
    limit, value, retry = 'budget_usd_month', f(S.month_usd + S.rsv_usd), '0'
  end
  if not limit and conc and flying >= conc then
    limit, value, retry = 'max_concurrent', tostring(flying), '0'
  end
  if not limit and rpm and n >= rpm then
    local at = redis.call('ZRANGE', K_REQ, n - rpm, n - rpm, 'WITHSCORES')
    limit, value, retry = 'rpm', tostring(n), f(math.max(0, tonumber(at[2]) + WINDOW - now))
  end
  local used = S.charged
  if not limit and tpm and used + tokens > tpm and used > 0 then
    local charges = redis.call('ZRANGE', K_CHG, 0, -1, 'WITHSCORES')
    local left, frees_at = used, now
    for i = 1, #charges, 2 do
      left = left - num(redis.call('HGET', K_TOK, charges[i]))
      frees_at = tonumber(charges[i + 1]) + WINDOW
      if left + tokens <= tpm or left <= 0 then break end
    end
    limit, value, retry = 'tpm', int(used), f(math.max(0, frees_at - now))
  end
  if limit then
    local head = 'refused ' .. limit .. ' ' .. value .. ' ' .. retry
    return answer(with_headers(head, n, first_at or ''), flying)
  end
  redis.call('ZADD', K_REQ, NOW, rid)
  redis.call('ZADD', K_CHG, NOW, rid)
  redis.call('HSET', K_TOK, rid, tokens)
  redis.call('ZADD', K_FLY, f(now + lease), rid)
  if n == 0 then  -- the windows were empty: these keys did not exist (they hold the same ids)
    redis.call('EXPIRE', K_REQ, KEEP)
    redis.call('EXPIRE', K_CHG, KEEP)
    redis.call('EXPIRE', K_TOK, KEEP)
  end
  if flying == 0 then redis.call('EXPIRE', K_FLY, KEEP) end
  S.charged = S.charged + tokens
  S.rsv_tokens, S.rsv_usd = S.rsv_tokens + tokens, S.rsv_usd + usd
  changed = true
  local hk = hold_key(rid)
  redis.call('DEL', hk)
  redis.call('HSET', hk, 'tokens', tokens, 'usd', f(usd), 'charge', tokens, 'reserved', '1',
    'released', '0', 'settled', 0)
  redis.call('EXPIRE', hk, HOLD_KEEP)
  local oldest = first_at  -- (a clock gone back leaves this one the oldest)
  if first_id == rid then  -- an id admitted again: its time moved (never, with the edges' ids)
    oldest = redis.call('ZRANGE', K_REQ, 0, 0, 'WITHSCORES')[2]
  elseif not oldest or now < tonumber(oldest) then
    oldest = NOW
  end
  return answer(with_headers('held   ', n + 1, oldest), flying + 1)
end

if op == 'settle' then
  return answer(settle(ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])))
end

if op == 'release' then
  return answer(release(ARGV[4], ARGV[5]))
end

if op == 'finish' then  -- a settle and the same request's release, posted one after the other
  return answer(finish(ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]))
end

if op == 'spend' then
  local id, tokens, usd = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  local at = wall
  if ARGV[7] ~= '' then at = tonumber(ARGV[7]) end
  keep()
  roll(periods(wall))
  if redis.call('SET', base .. ':op:' .. id, '1', 'NX', 'EX', HOLD_KEEP) then
    spend(tokens, usd, at)
    return answer('spent')
  end
  return answer('again')
end

if op == 'renew' then  -- the places still held get a new lease
  local expiry = f(now + tonumber(ARGV[4]))
  for i = 5, #ARGV do redis.call('ZADD', K_FLY, 'XX', expiry, ARGV[i]) end
  return answer('renewed')
end

if op == 'read' then
  return answer('read', (advance()))
end

return redis.error_reply('unknown operation ' .. tostring(op))
