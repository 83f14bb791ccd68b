-- The tenants' limits on Redis (dispatcher/store/limits_redis.py): one tenant's state under
-- KEYS[1], a base key holding the tenant's hash tag ("<prefix>{<tenant>}"); every key the
-- scripts touch is that base and a suffix, so one tenant's keys share a cluster slot.
--
-- ARGV[1], ARGV[2]: the monotonic and wall clocks as decimal strings, or both empty: the
-- server's TIME (the default; an injected clock is the tests' seam). ARGV[3]: the operation,
-- the rest its arguments. Every answer ends with the tenant's snapshot (in flight, then the
-- day and month spent). Numbers that are not integers travel as strings ("%.17g": the same
-- doubles as Python's), since Redis truncates a Lua number to an integer.
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
local HOLD_KEEP = 86400         -- a request's hold answers its settles for a day

local function f(x) return string.format('%.17g', x) end
local function num(s) return tonumber(s) or 0 end

local now, wall
if ARGV[1] ~= '' then
  now, wall = tonumber(ARGV[1]), tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  wall = now
end

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

local function periods(at)
  local y, m, d = civil(math.floor(at / 86400))
  return string.format('%04d-%02d-%02d', y, m, d), string.format('%04d-%02d', y, m)
end

local function hold_key(rid) return base .. ':hold:' .. rid end

local function unreserve(rid)
  local hk = hold_key(rid)
  local h = redis.call('HMGET', hk, 'reserved', 'tokens', 'usd')
  if h[1] ~= '1' then return end
  redis.call('HSET', hk, 'reserved', '0')
  redis.call('HINCRBY', K_ST, 'rsv_tokens', -num(h[2]))
  redis.call('HSET', K_ST, 'rsv_usd', f(num(redis.call('HGET', K_ST, 'rsv_usd')) - num(h[3])))
end

local function recharge(rid, tokens)
  local old = redis.call('HGET', K_TOK, rid)
  if old then  -- live: in the window still
    redis.call('HINCRBY', K_ST, 'charged', tokens - num(old))
    redis.call('HSET', K_TOK, rid, tokens)
  end
  redis.call('HSET', hold_key(rid), 'charge', tokens)
end

local function roll(day, month)
  local st = redis.call('HMGET', K_ST, 'day', 'month')
  if not st[1] or day > st[1] then
    redis.call('HSET', K_ST, 'day', day, 'day_tokens', 0, 'day_usd', '0')
  end
  if not st[2] or month > st[2] then
    redis.call('HSET', K_ST, 'month', month, 'month_tokens', 0, 'month_usd', '0')
  end
end

local function spend(tokens, usd, at)
  local day, month = periods(at)
  roll(day, month)
  local st = redis.call('HMGET', K_ST, 'day', 'day_usd', 'month', 'month_usd')
  if st[1] == day then  -- spend of an earlier period counts in it no more
    redis.call('HINCRBY', K_ST, 'day_tokens', tokens)
    redis.call('HSET', K_ST, 'day_usd', f(num(st[2]) + usd))
  end
  if st[3] == month then
    redis.call('HINCRBY', K_ST, 'month_tokens', tokens)
    redis.call('HSET', K_ST, 'month_usd', f(num(st[4]) + usd))
  end
end

local function advance()
  local cutoff = f(now - WINDOW)
  redis.call('ZREMRANGEBYSCORE', K_REQ, '-inf', cutoff)
  local gone = redis.call('ZRANGEBYSCORE', K_CHG, '-inf', cutoff)
  if #gone > 0 then
    local sum = 0
    for _, t in ipairs(redis.call('HMGET', K_TOK, unpack(gone))) do sum = sum + num(t) end
    redis.call('HINCRBY', K_ST, 'charged', -sum)
    redis.call('ZREM', K_CHG, unpack(gone))
    redis.call('HDEL', K_TOK, unpack(gone))
  end
  if redis.call('ZCARD', K_CHG) == 0 then redis.call('HSET', K_ST, 'charged', 0) end
  -- Leases run out: the holds of an edge that died (or never released them) come back.
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', K_FLY, '-inf', f(now))) do
    unreserve(rid)
    redis.call('HSET', hold_key(rid), 'released', '1')
  end
  redis.call('ZREMRANGEBYSCORE', K_FLY, '-inf', f(now))
  if redis.call('ZCARD', K_FLY) == 0 then  -- nothing in flight reserves anything
    redis.call('HSET', K_ST, 'rsv_tokens', 0, 'rsv_usd', '0')
  end
  roll(periods(wall))
end

local function keep()
  for _, key in ipairs({K_ST, K_REQ, K_CHG, K_TOK, K_FLY}) do redis.call('EXPIRE', key, KEEP) end
end

local function snapshot()
  local st = redis.call('HMGET', K_ST, 'day', 'day_tokens', 'day_usd', 'month',
    'month_tokens', 'month_usd')
  return {tostring(redis.call('ZCARD', K_FLY)), st[1] or '', st[2] or '0', st[3] or '0',
    st[4] or '', st[5] or '0', st[6] or '0'}
end

local function answer(head)
  local out = {f(now), f(wall)}
  for _, v in ipairs(head) do table.insert(out, v) end
  for _, v in ipairs(snapshot()) do table.insert(out, v) end
  return out
end

-- What the x-ratelimit headers need: requests in the window and the oldest one's time,
-- tokens charged and the oldest charge's time.
local function header_state()
  local oldest_req = redis.call('ZRANGE', K_REQ, 0, 0, 'WITHSCORES')
  local oldest_chg = redis.call('ZRANGE', K_CHG, 0, 0, 'WITHSCORES')
  return {tostring(redis.call('ZCARD', K_REQ)), oldest_req[2] or '',
    tostring(num(redis.call('HGET', K_ST, 'charged'))), oldest_chg[2] or ''}
end

local op = ARGV[3]
advance()
-- A tenant's keys are kept KEEP past its last admission or spend: what else comes (a
-- settle, a release, a renewal) follows an admission by at most HOLD_KEEP.
if op == 'admit' or op == 'spend' then keep() end

if op == 'admit' then
  local rid, tokens, usd, lease = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local rpm, tpm, conc = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  local st = redis.call('HMGET', K_ST, 'day_tokens', 'day_usd', 'month_tokens', 'month_usd',
    'rsv_tokens', 'rsv_usd', 'charged')
  local rsv_tokens, rsv_usd = num(st[5]), num(st[6])
  local budgets = {
    {'budget_tokens_day', tonumber(ARGV[11]), num(st[1]) + rsv_tokens},
    {'budget_usd_day', tonumber(ARGV[12]), num(st[2]) + rsv_usd},
    {'budget_tokens_month', tonumber(ARGV[13]), num(st[3]) + rsv_tokens},
    {'budget_usd_month', tonumber(ARGV[14]), num(st[4]) + rsv_usd},
  }
  local refusal = nil
  for _, b in ipairs(budgets) do
    if b[2] and b[3] >= b[2] then refusal = {b[1], f(b[3]), '0'}; break end
  end
  if not refusal and conc then
    local flying = redis.call('ZCARD', K_FLY)
    if flying >= conc then refusal = {'max_concurrent', tostring(flying), '0'} end
  end
  if not refusal and rpm then
    local n = redis.call('ZCARD', K_REQ)
    if n >= rpm then
      local at = redis.call('ZRANGE', K_REQ, n - rpm, n - rpm, 'WITHSCORES')
      refusal = {'rpm', tostring(n), f(math.max(0, tonumber(at[2]) + WINDOW - now))}
    end
  end
  local used = num(st[7])
  if not refusal and tpm and used + tokens > tpm and used > 0 then
    local charges = redis.call('ZRANGE', K_CHG, 0, -1, 'WITHSCORES')
    local left, frees_at = used, now
    for i = 1, #charges, 2 do
      left = left - num(redis.call('HGET', K_TOK, charges[i]))
      frees_at = tonumber(charges[i + 1]) + WINDOW
      if left + tokens <= tpm or left <= 0 then break end
    end
    refusal = {'tpm', tostring(used), f(math.max(0, frees_at - now))}
  end
  if refusal then
    local head = {'refused', refusal[1], refusal[2], refusal[3]}
    for _, v in ipairs(header_state()) do table.insert(head, v) end
    return answer(head)
  end
  local sn = f(now)
  redis.call('ZADD', K_REQ, sn, rid)
  redis.call('ZADD', K_CHG, sn, rid)
  redis.call('HSET', K_TOK, rid, tokens)
  redis.call('HINCRBY', K_ST, 'charged', tokens)
  redis.call('ZADD', K_FLY, f(now + lease), rid)
  redis.call('HINCRBY', K_ST, 'rsv_tokens', tokens)
  redis.call('HSET', K_ST, 'rsv_usd', f(rsv_usd + usd))
  local hk = hold_key(rid)
  redis.call('DEL', hk)
  redis.call('HSET', hk, 'tokens', tokens, 'usd', f(usd), 'charge', tokens, 'reserved', '1',
    'released', '0', 'settled', 0)
  redis.call('EXPIRE', hk, HOLD_KEEP)
  local head = {'held', '', '', ''}
  for _, v in ipairs(header_state()) do table.insert(head, v) end
  return answer(head)
end

if op == 'settle' then
  local rid, attempt, tokens, usd = ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
  local hk = hold_key(rid)
  if redis.call('HSETNX', hk, 's:' .. attempt, '1') == 0 then
    return answer({'again'})  -- this (request, attempt) settled before
  end
  redis.call('EXPIRE', hk, HOLD_KEEP)
  local h = redis.call('HMGET', hk, 'settled', 'charge', 'tokens')
  if h[3] then  -- the hold is known (else only the spend counts)
    local charge = tokens
    if num(h[1]) > 0 then charge = tokens + num(h[2]) end
    recharge(rid, charge)
    redis.call('HINCRBY', hk, 'settled', 1)
    unreserve(rid)
  end
  spend(tokens, usd, wall)
  return answer({'settled'})
end

if op == 'release' then
  local rid, answered = ARGV[4], ARGV[5]
  local hk = hold_key(rid)
  local h = redis.call('HMGET', hk, 'released', 'settled')
  if h[1] ~= '0' then return answer({'again'}) end  -- released before, or unknown
  redis.call('HSET', hk, 'released', '1')
  redis.call('ZREM', K_FLY, rid)
  unreserve(rid)
  if num(h[2]) == 0 and answered ~= '1' then recharge(rid, 0) end  -- it costs nothing
  return answer({'released'})
end

if op == 'spend' then
  local id, tokens, usd = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  local at = wall
  if ARGV[7] ~= '' then at = tonumber(ARGV[7]) end
  if redis.call('SET', base .. ':op:' .. id, '1', 'NX', 'EX', HOLD_KEEP) then
    spend(tokens, usd, at)
    return answer({'spent'})
  end
  return answer({'again'})
end

if op == 'renew' then  -- the places still held get a new lease
  local expiry = f(now + tonumber(ARGV[4]))
  for i = 5, #ARGV do redis.call('ZADD', K_FLY, 'XX', expiry, ARGV[i]) end
  return answer({'renewed'})
end

if op == 'read' then
  return answer({'read'})
end

return redis.error_reply('unknown operation ' .. tostring(op))
