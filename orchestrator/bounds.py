"""Mean response time of JFFC: Theorem 3.7 bounds (eqs 28-32) and exact analyses (App. A.3).

All functions take the chains as (service rate mu_k, capacity c_k) pairs, via ChainSpec or arrays,
and return a mean response time in seconds (Little's law, eq. 24), or math.inf when the system is
unstable (lambda >= nu).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import sparse
from scipy.sparse.linalg import spsolve
from scipy.special import logsumexp

from orchestrator.model import ChainSpec


@dataclass(frozen=True)
class ResponseTimeBounds:
    lower_s: float
    upper_s: float


def _rates_caps(chains: Sequence[ChainSpec]) -> tuple[np.ndarray, np.ndarray]:
    mu = np.array([1.0 / k.service_time_s for k in chains], dtype=float)
    cap = np.array([k.capacity for k in chains], dtype=np.int64)
    return mu, cap


def _birth_death_mean_occupancy(lam: float, death: np.ndarray) -> float:
    """E[Phi] of a birth-death chain with birth rate lam, death rates death[0..C-1] for n = 1..C
    and death[C-1] = nu for every n > C (eq. 39-40), computed in log space (eqs 30-32)."""
    C = len(death)
    nu = float(death[-1])
    rho = lam / nu
    # log b_n = sum_{i<=n} log(lam / nu_i), n = 0..C
    log_b = np.concatenate(([0.0], np.cumsum(math.log(lam) - np.log(death))))
    n = np.arange(C + 1, dtype=float)
    tail_mass = -math.log1p(-rho)  # log(1/(1-rho))
    tail_mean = math.log(rho / (1 - rho) ** 2 + C / (1 - rho))
    log_z = logsumexp(np.concatenate((log_b[:C], [log_b[C] + tail_mass])))
    if C > 1:
        log_num_terms = np.concatenate((log_b[1:C] + np.log(n[1:C]), [log_b[C] + tail_mean]))
    else:
        log_num_terms = np.array([log_b[C] + tail_mean])
    return float(math.exp(logsumexp(log_num_terms) - log_z))


def _contended_slot_rates(chains: Sequence[ChainSpec]) -> np.ndarray:
    """Per-slot rates, fastest first, where a chain's i-th session adds i / T(i) - (i-1) / T(i-1)
    (`ChainSpec.session_time_s`): the paper's chains give c_k slots of 1 / T_k; a contended chain's
    first session runs at its lone time and later ones add less (the chain's rate at c_k is the same
    c_k / T_k). Sorted, this is the lower bound's "jobs on the fastest slots" for such chains."""
    rates = []
    for k in chains:
        prev = 0.0
        for i in range(1, k.capacity + 1):
            cur = i / k.session_time_s(i)
            rates.append(max(cur - prev, 0.0))
            prev = cur
    return np.sort(np.array(rates, dtype=float))[::-1]


def theorem37_bounds(chains: Sequence[ChainSpec], arrival_rate_per_s: float) -> ResponseTimeBounds:
    """Lower/upper bounds on JFFC's mean response time (Theorem 3.7 with eq. 24).

    Lower: death rates nu-bar_n (eq. 28): the n jobs sit on the fastest slots. Upper: nu-underbar_n
    (eq. 29): on the slowest. Both are cumulative sums of the per-slot rates, sorted.

    Contended chains (`ChainSpec.lone_time_s` set; not the paper's): the lower bound's slots follow
    the chain's session time at each occupancy (`_contended_slot_rates`: a single session on a
    shared server runs at its lone time, not at the full chain's busy time); the upper bound keeps
    c_k slots of 1 / T_k (every session at the full chain's time: the pessimistic end). Without this
    the lower bound charged a lone session the busy time of a full chain, which favoured splitting a
    server's range over more hops at any load (Table 1 quick runs, docs/results.md: c* = 10-11 with 3-hop
    chains and twice the mean response of the c = 1 plan)."""
    mu, cap = _rates_caps(chains)
    lam = float(arrival_rate_per_s)
    if len(mu) == 0:
        return ResponseTimeBounds(math.inf, math.inf)
    nu = float(np.dot(mu, cap))
    if not lam < nu:
        return ResponseTimeBounds(math.inf, math.inf)
    order = np.argsort(-mu, kind="stable")
    slot_rates_fast_first = np.repeat(mu[order], cap[order])
    contended = any(k.lone_time_s is not None for k in chains)
    fast = np.cumsum(_contended_slot_rates(chains) if contended else slot_rates_fast_first)
    slow = np.cumsum(slot_rates_fast_first[::-1])
    fast[-1] = slow[-1] = nu  # exact equality at n = C for the tail
    lower = _birth_death_mean_occupancy(lam, fast) / lam
    upper = _birth_death_mean_occupancy(lam, slow) / lam
    return ResponseTimeBounds(lower, max(upper, lower))


def exact_k2_mean_response_time(mu1: float, c1: int, mu2: float, c2: int, arrival_rate_per_s: float) -> float:
    """Exact steady-state mean response time of JFFC with K = 2 chains (App. A.3, eqs 46-53).

    Chain 1 must be the faster one (mu1 >= mu2). alpha_z = pi_z / pi_{0,0,c2}; the recursion runs
    row by row from z2 = c2 down to 0."""
    if mu1 < mu2:
        raise ValueError("chain 1 must be the faster chain (mu1 >= mu2)")
    lam = float(arrival_rate_per_s)
    nu = c1 * mu1 + c2 * mu2
    if not lam < nu:
        return math.inf
    alpha = np.zeros((c1 + 1, c2 + 1))  # alpha[z1, z2] for states (0, z1, z2)
    alpha[0, c2] = 1.0
    for n in range(1, c1 + 1):  # eq. (46)
        alpha[n, c2] = (c2 * mu2 * alpha[:n, c2].sum() + lam * alpha[n - 1, c2]) / (n * mu1)
    for z2 in range(c2 - 1, -1, -1):
        upper_sum = alpha[:, z2 + 1]
        alpha_full = (z2 + 1) * mu2 / lam * upper_sum.sum()  # eq. (48)
        if c1 == 0:
            alpha[0, z2] = alpha_full
            continue
        beta = np.zeros(c1 + 1)
        gamma = np.zeros(c1 + 1)
        beta[0] = 1.0
        for n in range(1, c1 + 1):  # eqs (50), (51)
            beta[n] = (z2 * mu2 * beta[:n].sum() + lam * beta[n - 1]) / (n * mu1)
            gamma[n] = (z2 * mu2 * gamma[:n].sum() + lam * gamma[n - 1] - (z2 + 1) * mu2 * upper_sum[:n].sum()) / (
                n * mu1
            )
        a0 = (alpha_full - gamma[c1]) / beta[c1]  # eq. (52)
        alpha[:, z2] = beta * a0 + gamma
        alpha[c1, z2] = alpha_full
    z1 = np.arange(c1 + 1)[:, None]
    z2v = np.arange(c2 + 1)[None, :]
    tail = lam * alpha[c1, c2] / (nu - lam)
    num = float((alpha * (z1 + z2v)).sum()) + tail * (nu / (nu - lam) + c1 + c2)  # eq. (53)
    den = float(alpha.sum()) + tail
    return num / den / lam


def exact_ctmc_mean_response_time(
    chains: Sequence[ChainSpec], arrival_rate_per_s: float, max_states: int = 200_000
) -> float:
    """Exact mean response time of JFFC for any small K, by solving the CTMC (eq. 23) directly.

    States of Z_1 (no queue) are solved as a sparse linear system; the queue states Z_2 form a
    geometric tail pi_{n,c} = rho^n pi_{0,c} whose in/out flows at (0, c) cancel, so Z_1 alone is a
    loss system in which arrivals at the full state are dropped."""
    mu, cap = _rates_caps(chains)
    order = np.argsort(-mu, kind="stable")
    mu, cap = mu[order], cap[order]
    lam = float(arrival_rate_per_s)
    nu = float(np.dot(mu, cap))
    if not lam < nu:
        return math.inf
    dims = tuple(int(c) + 1 for c in cap)
    n_states = int(np.prod(dims))
    if n_states > max_states:
        raise ValueError(f"{n_states} states exceed max_states={max_states}")
    states = np.array(np.unravel_index(np.arange(n_states), dims)).T  # rows: z_1..z_K
    rows, cols, vals = [], [], []
    for s_idx, z in enumerate(states):
        free = np.nonzero(z < cap)[0]
        if len(free):
            first = free[0]  # fastest chain with a free slot
            z2 = z.copy()
            z2[first] += 1
            rows.append(s_idx)
            cols.append(int(np.ravel_multi_index(z2, dims)))
            vals.append(lam)
        for busy in np.nonzero(z > 0)[0]:
            z2 = z.copy()
            z2[busy] -= 1
            rows.append(s_idx)
            cols.append(int(np.ravel_multi_index(z2, dims)))
            vals.append(z[busy] * mu[busy])
    Q = sparse.coo_matrix((vals, (rows, cols)), shape=(n_states, n_states)).tocsr()
    Q = Q - sparse.diags(np.asarray(Q.sum(axis=1)).ravel())
    A = Q.T.tolil()
    A[0, :] = np.ones(n_states)  # replace one balance equation by normalisation
    b = np.zeros(n_states)
    b[0] = 1.0
    p = spsolve(A.tocsr(), b)
    occupancy = states.sum(axis=1).astype(float)
    full = n_states - 1  # (c_1, ..., c_K) is the last index
    rho = lam / nu
    C = float(cap.sum())
    p_full = p[full]
    mass = p.sum() + p_full * rho / (1 - rho)
    mean = float(p @ occupancy) + p_full * (C * rho / (1 - rho) + rho / (1 - rho) ** 2)
    return mean / mass / lam
