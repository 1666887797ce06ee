"""KDA's chunked forward as our own two Triton kernels: inference only (rollouts, teacher prefill).

Why it exists: rollouts and teacher prefill only need o and the final state, never gradients, yet
fla's `chunk_kda` forward keeps what training needs (the state entering every chunk, written to
memory and read back by a separate output kernel). Here the state of a (sequence, head, V-block)
never leaves registers, and nothing beyond Triton is needed (no flash-linear-attention).

The math is `chunk.py`'s WY / UT form on 16-token tiles, which K3's bounded gate (g >= -5 per
token, so a tile's cumulative log-decay G stays in [-80, 0]) lets us build densely with the split
exp(G_i - G_j) = exp(G_i + c) * exp(-G_j - c), c = 40 (see `chunk.MAX_CHUNK_LOG_DECAY`):

1. `_dense_intra_kernel` (`IntraConfig` sets its variant), one program per (tile, head),
   everything that does not depend on the state:
   A_kk (strictly lower, scaled by beta) and its unit-triangular inverse X = (I + A_kk)^-1 on the
   16 x 16 tile (by doubling, or forward substitution); u = X beta v and w = X (beta k exp(G)), so
   delta = u - w S0; the causal query-key tile A_qk = scale <q_i exp(G_i - G_j), k_j>; q exp(G)
   scale, k exp(G_C - G) and the tile's decay exp(G_C). Per-token results keep the inputs' token
   layout.
2. `_scan_kernel`, one program per (sequence, head, V-block), walks the sequence's tiles in order
   keeping S [K, BV] (transposed) in float32 registers:
       delta = u - w S;   o = (q exp(G) scale) S + A_qk delta;   S = exp(G_C) S + (k exp(G_C - G))^T delta
   and writes o and the final state; no per-tile state is stored. The loop's pipelining stages the
   matmul operands in shared memory; u and the decay are loaded a tile ahead into registers.

A tile whose cumulative log-decay goes below -80 (a gate steeper than K3's bound) would overflow the
split; the intra kernel then writes NaN for that tile instead of a silently wrong number, since
checking g on the host would cost a device sync per call.

Products accumulate in float32. The intra-tile products are IEEE float32 for float32 inputs and, by
default, "bf16x3" for 16-bit inputs (three bf16 tensor-core products of split operands: a 16-bit
mantissa); `IntraConfig` offers others (`tf32`, `bf16`: cheaper, less accurate, opt-in, their errors
in the tests). For 16-bit inputs the
scan's matmul operands (w, the q and k factors, u, and S, delta, A_qk rounded each tile) are in
the inputs' dtype, as in fla; `precise=True` keeps S, delta and A_qk in float32 (TF32 products).
For float32 inputs everything stays IEEE float32 (a correctness path, not tuned).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from posttrain.ops.kda.inputs import check_kda_inputs
from posttrain.ops.triton_support import triton_serves

try:  # Triton ships with CUDA builds of torch, not always with the CPU build
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TILE = 16  # tokens per tile: the smallest tl.dot side, and 16 * 5 = 80 fits the exp split.
SHIFT = 40.0  # c in exp(G_i + c) * exp(-G_j - c): centres G in [-80, 0] on 0.
MAX_TILE_LOG_DECAY = 80.0
MAX_K = 256  # the scan keeps all K rows of its state block in registers
PRECISIONS = ("ieee", "tf32x3", "bf16x3", "tf32", "bf16")  # the dense intra kernel's products (`IntraConfig`)

if triton is not None:

    @triton.jit
    def _dense_dot(a, b, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
        """`_dot_2d` of [NH, M, K] @ [NH, K, N]; for NH = 1 as 2D products, since Triton 3.6 puts
        every warp of a batched product on its batch axis (sm90 compile of the default config: 239
        registers a thread batched, 167 in 2D)."""
        if a.shape[0] == 1:
            a2 = tl.reshape(a, (a.shape[1], a.shape[2]))
            b2 = tl.reshape(b, (b.shape[1], b.shape[2]))
            return tl.reshape(_dot_2d(a2, b2, PRECISION, EMULATE), (1, a.shape[1], b.shape[2]))
        return _dot_2d(a, b, PRECISION, EMULATE)

    @triton.jit
    def _dot_2d(a, b, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
        """a @ b of float32 tensors (2D or 3D) with float32 accumulation. PRECISION: "ieee" (FMA
        units), "bf16x3" (a = a_hi + a_lo, both bf16, likewise b: a_hi b_hi + a_hi b_lo + a_lo b_hi
        on tensor cores, 16 mantissa bits), "tf32x3" (Triton's same split into TF32 parts: about
        float32's accuracy), "tf32" or "bf16" (one tensor-core product on operands cut to 10 / 8
        mantissa bits). EMULATE (the interpreter, which ignores input_precision and multiplies
        16-bit operands wrongly): cut the operands as the GPU does, truncating to TF32 (the tensor
        core ignores the low 13 bits) and rounding to bf16, then multiply in float32; "tf32x3"
        runs as float32."""
        if PRECISION == "bf16x3":
            a_hi = a.to(tl.bfloat16)
            b_hi = b.to(tl.bfloat16)
            a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
            b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
            if EMULATE:
                a_hi, b_hi, a_lo, b_lo = (
                    a_hi.to(tl.float32),
                    b_hi.to(tl.float32),
                    a_lo.to(tl.float32),
                    b_lo.to(tl.float32),
                )
                acc = tl.dot(a_hi, b_lo, input_precision="ieee")
                acc = tl.dot(a_lo, b_hi, acc, input_precision="ieee")
                return tl.dot(a_hi, b_hi, acc, input_precision="ieee")
            acc = tl.dot(a_hi, b_lo)
            acc = tl.dot(a_lo, b_hi, acc)
            return tl.dot(a_hi, b_hi, acc)
        elif PRECISION == "bf16":
            if EMULATE:
                return tl.dot(
                    a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee"
                )
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif PRECISION == "tf32":
            if EMULATE:
                a = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                b = (b.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                return tl.dot(a, b, input_precision="ieee")
            return tl.dot(a, b, input_precision="tf32")
        elif PRECISION == "tf32x3":
            if EMULATE:
                return tl.dot(a, b, input_precision="ieee")
            return tl.dot(a, b, input_precision="tf32x3")
        else:
            return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _dense_load(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tile_start_ptr, tile_end_ptr, tile, ok, h0, H, K, V,
        NH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        """Tile `tile`'s bounds and inputs for heads h0 .. h0 + NH, in the inputs' dtypes; with `ok`
        false a tile of no rows (end = start), whose masked loads move nothing."""
        start = tl.load(tile_start_ptr + tile).to(tl.int64)
        end = tl.where(ok, tl.load(tile_end_ptr + tile).to(tl.int64), start)
        rows = tl.arange(0, 16)
        heads = tl.arange(0, NH)
        kcols = tl.arange(0, BK)
        vcols = tl.arange(0, BV)
        row_ok = (rows[None, :] < end - start) & (h0 + heads < H)[:, None]  # [NH, 16]
        # Offsets within the tile as int32 from one int64 base: token-major, then head, channel.
        th = rows[None, :] * H + heads[:, None]  # [NH, 16]: row of [tokens * H, ...]
        base = start * H + h0
        k_mask = row_ok[:, :, None] & (kcols < K)[None, None, :]
        at_k = th[:, :, None] * K + kcols[None, None, :]
        v_mask = row_ok[:, :, None] & (vcols < V)[None, None, :]
        at_v = th[:, :, None] * V + vcols[None, None, :]
        # Padded rows and channels read 0: they write nothing and leave the tile's decay alone.
        beta = tl.load(beta_ptr + base + th, mask=row_ok, other=0.0)
        k = tl.load(k_ptr + base * K + at_k, mask=k_mask, other=0.0)
        q = tl.load(q_ptr + base * K + at_k, mask=k_mask, other=0.0)
        g = tl.load(g_ptr + base * K + at_k, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + base * V + at_v, mask=v_mask, other=0.0)
        return start, end, beta, k, q, g, v

    @triton.jit
    def _dense_intra_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tile_start_ptr, tile_end_ptr,
        w_ptr, u_ptr, qd_ptr, kd_ptr, aqk_ptr, decay_ptr,
        scale, num_tiles, H, K, V,
        NH: tl.constexpr, TILES: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        SHIFT: tl.constexpr, MAX_DECAY: tl.constexpr, PRECISION: tl.constexpr,
        WU_PRECISION: tl.constexpr, INVERSE: tl.constexpr, STACK: tl.constexpr, EMULATE: tl.constexpr,
    ):  # fmt: skip
        """Step 1 of the module docstring, one program per (TILES consecutive tiles, NH heads) with all K
        channels at once: the loads are issued one tile ahead (the next tile's inputs load while
        this one computes: with 2-3 programs an SM, as registers allow, a program's own compute
        would otherwise leave its SM's memory pipe idle), no K loop (q / k / g read once),
        the products on tensor cores (PRECISION, see `_dense_dot`), and (I + A)^-1 from log2(16) = 4
        doubling steps (INVERSE="doubling": (I - A)(I + A^2)(I + A^4)(I + A^8), exact since A is
        strictly lower triangular, so A^16 = 0) instead of 16 dependent row steps ("substitution").
        Tensors are [NH, 16, ...]: head, token, channel."""
        pid = tl.program_id(0).to(tl.int64)
        HB = tl.cdiv(H, NH)
        first = (pid // HB) * TILES
        h0 = (pid % HB) * NH
        rows = tl.arange(0, 16)
        heads = tl.arange(0, NH)
        kcols = tl.arange(0, BK)
        vcols = tl.arange(0, BV)
        th = rows[None, :] * H + heads[:, None]  # [NH, 16]: row of [tokens * H, ...]
        at_k = th[:, :, None] * K + kcols[None, None, :]
        at_v = th[:, :, None] * V + vcols[None, None, :]
        i = rows[None, :, None]
        j = rows[None, None, :]
        start, end, beta_in, k_in, q_in, g_in, v_in = _dense_load(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tile_start_ptr, tile_end_ptr, first, first < num_tiles,
            h0, H, K, V, NH, BK, BV,
        )  # fmt: skip
        for step in range(TILES):
            tile = first + step
            # The next tile's loads go out before this tile's work (the last one loads nothing).
            ok = (step + 1 < TILES) & (tile + 1 < num_tiles)
            n_start, n_end, n_beta, n_k, n_q, n_g, n_v = _dense_load(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tile_start_ptr, tile_end_ptr,
                tl.minimum(tile + 1, num_tiles - 1), ok, h0, H, K, V, NH, BK, BV,
            )  # fmt: skip
            row_ok = (rows[None, :] < end - start) & (h0 + heads < H)[:, None]  # [NH, 16]
            base = start * H + h0
            k_mask = row_ok[:, :, None] & (kcols < K)[None, None, :]
            v_mask = row_ok[:, :, None] & (vcols < V)[None, None, :]
            beta = beta_in.to(tl.float32)
            k = k_in.to(tl.float32)
            q = q_in.to(tl.float32)
            v = v_in.to(tl.float32)
            G = tl.cumsum(g_in.to(tl.float32), 1)
            G_last = tl.sum(tl.where(i == 15, G, 0.0), 1)  # [NH, BK]; padded rows add g = 0
            worst = tl.min(tl.min(G, 2), 1)  # [NH]: each head's most negative G in the tile

            # The terms that need no inverse, stored first so q's registers free early.
            decay = tl.exp(G)
            tl.store(qd_ptr + base * K + at_k, (scale * q * decay).to(qd_ptr.dtype.element_ty), mask=k_mask)
            kd = k * tl.exp(G_last[:, None, :] - G)
            tl.store(kd_ptr + base * K + at_k, kd.to(kd_ptr.dtype.element_ty), mask=k_mask)
            at_decay = (tile * H + h0 + heads[:, None]) * K + kcols[None, :]
            k_live = tl.where(tile < num_tiles, K, 0)  # no decay row past the last tile
            decay_ok = (h0 + heads < H)[:, None] & (kcols < k_live)[None, :]
            tl.store(decay_ptr + at_decay, tl.exp(G_last), mask=decay_ok)

            k_out = tl.trans(k * tl.exp(-G - SHIFT), (0, 2, 1))  # [NH, BK, 16]
            # A_kk and A_qk as one product of the rows [k; q] exp(G + c) (M = 32): at M = 16 each of
            # 4 warps would hold the whole left operand (sm90 compile, bf16x3: 181 registers a
            # thread apart, 167 stacked, so 3 programs an SM instead of 2).
            e_in = tl.exp(G + SHIFT)
            if STACK:
                stacked = tl.reshape(tl.permute(tl.join(k * e_in, q * e_in), (0, 3, 1, 2)), (NH, 32, BK))
                both = tl.reshape(_dense_dot(stacked, k_out, PRECISION, EMULATE), (NH, 2, 16, 16))
                a_kk, a_qk = tl.split(tl.permute(both, (0, 2, 3, 1)))
            else:
                a_kk = _dense_dot(k * e_in, k_out, PRECISION, EMULATE)
                a_qk = _dense_dot(q * e_in, k_out, PRECISION, EMULATE)
            a_kk = tl.where(i > j, beta[:, :, None] * a_kk, 0.0)
            a_qk = tl.where(i >= j, scale * a_qk, 0.0)
            tl.store(aqk_ptr + base * 16 + th[:, :, None] * 16 + j, a_qk, mask=row_ok[:, :, None])

            # X = (I + A)^-1, in IEEE float32 whatever PRECISION (16 x 16 x 16 products: cheap).
            if INVERSE == "doubling":
                x = tl.where(i == j, 1.0, 0.0) - a_kk
                power = a_kk
                for _ in tl.static_range(3):
                    power = _dense_dot(power, power, "ieee", EMULATE)
                    x += _dense_dot(x, power, "ieee", EMULATE)
            else:
                x = tl.zeros([NH, 16, 16], tl.float32)
                for r in tl.static_range(16):
                    a_r = tl.sum(tl.where(i == r, a_kk, 0.0), 1)  # [NH, 16]: row r of A by column
                    x_r = tl.where(rows[None, :] == r, 1.0, 0.0) - tl.sum(a_r[:, :, None] * x, 1)
                    x = tl.where(i == r, x_r[:, None, :], x)
            # A tile steeper than the split allows: NaN rather than an overflowed, plausible result.
            x += tl.where(worst[:, None, None] < -MAX_DECAY, float("nan"), 0.0)

            w = _dense_dot(x, beta[:, :, None] * k * decay, WU_PRECISION, EMULATE)
            tl.store(w_ptr + base * K + at_k, w.to(w_ptr.dtype.element_ty), mask=k_mask)
            u = _dense_dot(x, beta[:, :, None] * v, WU_PRECISION, EMULATE)
            tl.store(u_ptr + base * V + at_v, u.to(u_ptr.dtype.element_ty), mask=v_mask)
            start, end, beta_in, k_in, q_in, g_in, v_in = n_start, n_end, n_beta, n_k, n_q, n_g, n_v

    @triton.jit
    def _scan_side(u_ptr, decay_ptr, bos, t, L, n_tiles, first_tile, h, H, K, V, off_vt, rows, kcols, v_ok):
        """Tile t's u^T [BV, 16] (inputs' dtype) and decay [BK] of one sequence; nothing (zeros, no
        memory traffic) for t past the sequence's last tile."""
        row_ok = rows < L - t * 16
        u = tl.load(
            u_ptr + ((bos + t * 16) * H + h) * V + off_vt, mask=v_ok[:, None] & row_ok[None, :], other=0.0
        )
        at = ((first_tile + t) * H + h) * K + kcols
        decay = tl.load(decay_ptr + at, mask=kcols < tl.where(t < n_tiles, K, 0), other=0.0)
        return u, decay

    @triton.jit
    def _scan_kernel(
        w_ptr, u_ptr, qd_ptr, kd_ptr, aqk_ptr, decay_ptr, bounds_ptr, first_tile_ptr,
        h0_ptr, o_ptr, ht_ptr, H, K, V,
        BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
        HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr,
        PRECISE: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """Carries the transposed state S^T [BV, BK], so the recurrence runs accumulator ->
        left operand of the next product: delta^T = u^T - S^T w^T, S^T <- S^T exp(G_C) + delta^T kd.
        An accumulator can feed a left operand in registers, while the tile's loaded terms (w, q, k,
        A_qk) are right operands that the loop's pipelining stages in shared memory. In the sm90
        compile at BV = 64, 4 warps (Hopper warp-group MMAs, warps split by rows) the whole
        S -> delta -> S chain stays in registers; narrower blocks (mma.sync, warps split by
        columns) route S and delta through shared memory each tile."""
        vb = tl.program_id(0)
        n = tl.program_id(1).to(tl.int64)
        h = tl.program_id(2)
        bos = tl.load(bounds_ptr + n).to(tl.int64)
        eos = tl.load(bounds_ptr + n + 1).to(tl.int64)
        first_tile = tl.load(first_tile_ptr + n).to(tl.int64)
        rows = tl.arange(0, 16)
        kcols = tl.arange(0, BK)
        vcols = vb * BV + tl.arange(0, BV)
        k_ok = kcols < K
        v_ok = vcols < V
        # The matmul operand dtype: the inputs' 16-bit dtype, or fp32. Triton's interpreter
        # multiplies 16-bit operands wrongly (Triton 3.9), so there (UPCAST) operands are rounded to
        # dt and then widened: the same values the GPU's fp32-accumulating MMA multiplies. PRECISE
        # keeps S, delta and A_qk in fp32 (TF32 products on the GPU) for 16-bit inputs: about half
        # the error of rounding them to 16 bits each tile.
        dt = w_ptr.dtype.element_ty
        op = tl.float32 if UPCAST or PRECISE else dt
        rnd = tl.float32 if PRECISE else dt  # what S, delta and A_qk are rounded to as operands

        state_at = (n * H + h) * K * V + kcols[None, :] * V + vcols[:, None]  # S^T[v, k] = S[k, v]
        state_mask = v_ok[:, None] & k_ok[None, :]
        if HAS_H0:
            S_t = tl.load(h0_ptr + state_at, mask=state_mask, other=0.0).to(tl.float32)
        else:
            S_t = tl.zeros([BV, BK], tl.float32)

        # Addresses as a scalar 64-bit base per tile plus loop-invariant 32-bit offsets within it:
        # a 64-bit address per element would cost registers the state needs.
        off_kt = kcols[:, None] + rows[None, :] * (H * K)  # [BK, 16]: w^T, (q exp(G))^T
        off_k = rows[:, None] * (H * K) + kcols[None, :]  # [16, BK]: k exp(G_C - G)
        off_vt = vcols[:, None] + rows[None, :] * (H * V)  # [BV, 16]: u^T, o^T
        off_at = rows[:, None] + rows[None, :] * (H * 16)  # [16, 16]: A_qk^T
        L = eos - bos
        n_tiles = tl.cdiv(L, 16)
        # u and the decay enter elementwise, not as matmul operands, so the loop's pipelining does
        # not stage them (the sm90 compile loads them with plain LDGs, each tile waiting on memory);
        # PREFETCH > 0 loads them that many tiles ahead into registers instead (past the sequence's
        # last tile: masked, nothing moves).
        if PREFETCH >= 1:
            u_1, decay_1 = _scan_side(
                u_ptr, decay_ptr, bos, 0, L, n_tiles, first_tile, h, H, K, V, off_vt, rows, kcols, v_ok
            )
        if PREFETCH >= 2:
            u_2, decay_2 = _scan_side(
                u_ptr, decay_ptr, bos, 1, L, n_tiles, first_tile, h, H, K, V, off_vt, rows, kcols, v_ok
            )
        for t in tl.range(0, n_tiles, num_stages=NUM_STAGES):
            first = (bos + t * 16) * H + h  # the tile's first token, as a row of [tokens * H, ...]
            row_ok = rows < L - t * 16
            mask_kt = k_ok[:, None] & row_ok[None, :]
            mask_vt = v_ok[:, None] & row_ok[None, :]
            w_t = tl.load(w_ptr + first * K + off_kt, mask=mask_kt, other=0.0).to(op)
            qd_t = tl.load(qd_ptr + first * K + off_kt, mask=mask_kt, other=0.0).to(op)
            kd = tl.load(kd_ptr + first * K + off_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(op)
            a_qk_t = tl.load(aqk_ptr + first * 16 + off_at, mask=row_ok[None, :], other=0.0)
            if PREFETCH == 0:
                u_t, decay = _scan_side(
                    u_ptr, decay_ptr, bos, t, L, n_tiles, first_tile, h, H, K, V, off_vt, rows, kcols, v_ok
                )
            elif PREFETCH == 1:
                u_t, decay = u_1, decay_1
                u_1, decay_1 = _scan_side(
                    u_ptr, decay_ptr, bos, t + 1, L, n_tiles, first_tile, h, H, K, V, off_vt, rows, kcols,
                    v_ok,
                )  # fmt: skip
            else:
                u_t, decay = u_1, decay_1
                u_1, decay_1 = u_2, decay_2
                u_2, decay_2 = _scan_side(
                    u_ptr, decay_ptr, bos, t + 2, L, n_tiles, first_tile, h, H, K, V, off_vt, rows, kcols,
                    v_ok,
                )  # fmt: skip
            u_t = u_t.to(tl.float32)

            S_op = S_t.to(rnd).to(op)
            delta_t = u_t - tl.dot(S_op, w_t, input_precision=PRECISION)
            delta_op = delta_t.to(rnd).to(op)
            o_t = tl.dot(S_op, qd_t, input_precision=PRECISION)
            o_t = tl.dot(delta_op, a_qk_t.to(rnd).to(op), o_t, input_precision=PRECISION)
            tl.store(o_ptr + first * V + off_vt, o_t.to(o_ptr.dtype.element_ty), mask=mask_vt)
            S_t = tl.dot(delta_op, kd, S_t * decay[None, :], input_precision=PRECISION)

        if STORE_HT:
            tl.store(ht_ptr + state_at, S_t, mask=state_mask)


def refusal(tensors: list[torch.Tensor]) -> Exception | None:
    """Why our forward cannot take these inputs (q first, then k, v, g, beta and any initial
    state), as the error `triton_chunk_kda` raises; None when it can. `chunk_kda(backend="auto")`
    asks it too, to take this forward on a GPU without fla."""
    q = tensors[0]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return RuntimeError(
            "chunk_kda(backend='triton') is forward-only (no backward): call it under torch.no_grad() "
            "or torch.inference_mode(), or use backend='fla' / 'torch' to train"
        )
    if not triton_serves(*tensors):
        return RuntimeError(
            "chunk_kda(backend='triton') needs Triton and CUDA tensors of float32/bfloat16/float16 "
            "(or CPU tensors under TRITON_INTERPRET=1); got "
            f"{q.device} {', '.join(sorted({str(t.dtype) for t in tensors}))}"
            + ("" if triton is not None else ", and triton is not installed")
        )
    if q.shape[-1] > MAX_K:
        return ValueError(
            f"chunk_kda(backend='triton'): K={q.shape[-1]} is above the {MAX_K} the scan holds in registers"
        )
    return None


def triton_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precise: bool = False,
    intra: IntraConfig | None = None,
    prefetch: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward-only `chunk_kda` (same arguments, layout and results) on our Triton kernels.

    g must keep each 16-token tile's cumulative log-decay >= -80 (K3's gate, g >= -5, always does);
    tiles beyond that come out NaN. block_v, num_warps and num_stages tune the scan kernel
    (`bench/kda_fwd_gpu.py --sweep`); the defaults are chosen for K = V = 128 on an H200. precise
    (16-bit inputs): the scan's state, delta and A_qk enter its products as float32 (TF32 on the
    GPU) instead of being rounded to the inputs' dtype each tile. intra picks and tunes the
    intra-tile kernel (`IntraConfig`; default `IntraConfig()`). prefetch: how many tiles ahead the
    scan loads each tile's u and decay (0, the default: in their own tile, as the first version; 1
    or 2: ahead, not yet run on a GPU; see `_scan_prefetch`).

    Raises RuntimeError when gradients are required (there is no backward) or when Triton cannot
    run here (CUDA tensors, or CPU ones under TRITON_INTERPRET=1).
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    tensors = [q, k, v, g, beta] + ([] if initial_state is None else [initial_state])
    if (error := refusal(tensors)) is not None:
        raise error
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    device = q.device
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if T == 0 or B == 0:
        o = v.new_zeros(B, T, H, V)
        if not output_final_state:
            return o, None
        return o, (h0.clone() if h0 is not None else torch.zeros(N, H, K, V, device=device))

    bounds = tuple(b * T for b in range(B + 1)) if cu_seqlens is None else tuple(cu_seqlens.tolist())
    tiles = tile_tables(bounds, device)
    terms = intra_terms(q, k, v, g, beta, scale, tiles, intra)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=device) if output_final_state else None
    BV = block_v or _default_block_v(V, terms.w.dtype)
    _scan_kernel[(triton.cdiv(V, BV), N, H)](
        terms.w, terms.u, terms.qd, terms.kd, terms.aqk, terms.decay, tiles.bounds, tiles.first_tile,
        h0 if h0 is not None else o, o, ht if ht is not None else o, H, K, V,
        BK=_block_k(K), BV=BV, PRECISION=terms.precision, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, NUM_STAGES=num_stages or 2, UPCAST=not q.is_cuda, PRECISE=precise,
        PREFETCH=_scan_prefetch(prefetch),
        num_warps=num_warps or 4,
    )  # fmt: skip
    return o, ht


@dataclass(frozen=True)
class TileTables:
    """int32 device tables of one packed row: each tile's [start, end) token, each document's
    [bos, eos) (`bounds`, N + 1) and first tile. Documents start on a tile boundary."""

    start: torch.Tensor
    end: torch.Tensor
    bounds: torch.Tensor
    first_tile: torch.Tensor


@functools.lru_cache(maxsize=64)
def tile_tables(bounds: tuple[int, ...], device: torch.device) -> TileTables:
    """Cached per layout: building them is a host loop and a host-to-device copy, which would
    otherwise wait for the GPU's queue on every call of a fixed-shape prefill."""
    starts: list[int] = []
    ends: list[int] = []
    first_tile: list[int] = []
    for bos, eos in itertools.pairwise(bounds):
        first_tile.append(len(starts))
        starts.extend(range(bos, eos, TILE))
        ends.extend(min(s + TILE, eos) for s in range(bos, eos, TILE))
    return TileTables(
        *(torch.tensor(x, dtype=torch.int32, device=device) for x in (starts, ends, bounds, first_tile))
    )


@dataclass(frozen=True)
class IntraConfig:
    """How `_dense_intra_kernel` computes the scan's per-tile terms; `bench/kda_fwd_gpu.py --sweep`
    times the alternatives. (A first kernel, 32-channel blocks read twice with IEEE float32 products
    on the FMA units and the inverse row by row, took 3.50 ms for the whole forward against this
    default's 2.61 at B1 T8192 H96 K=V=128 bf16 on an H200, bench/RESULTS.md; it was removed.)

    heads: heads per program (a power of 2): more amortise the program's fixed latency
        and issue more bytes per load, at more registers per thread (batched products: with
        Triton 3.6, 2 heads at 4 or 8 warps reach 255 registers and spill).
    tiles: consecutive tiles per program, each tile's inputs loaded while the one before
        computes (1: no overlap within a program). The prefetched inputs cost registers: at 4
        warps "bf16x3" goes from 167 a thread (3 programs an SM) to 254 (2), "bf16" from 125 (4)
        to 251 (2); so 1 by default until the sweep has timed it.
    precision: the kernel's A_kk, A_qk, w and u products for 16-bit inputs (float32 inputs
        always get "ieee"), all with float32 accumulation: "bf16x3" (each operand split into two
        bf16 parts, three tensor-core products: a 16-bit mantissa; errors as "ieee"'s to 3 digits for
        bf16 inputs, +12% for fp16, all tested), "tf32x3" (the same with TF32 parts, about float32's
        accuracy, at more registers: 216 a thread against bf16x3's 167),
        "ieee" (FMA units), "tf32" or "bf16" (one tensor-core product on cut operands: less
        accurate, opt-in; see the tests' measured errors).
    wu_precision: the same choice for the w and u products alone (None: precision's). Their results
        are rounded to the inputs' 16-bit dtype anyway, so cut operands cost less there; precision
        "bf16" costs accuracy (see the tests), "tf32" little.
    inverse: "doubling" (4 dependent 16 x 16 products) or "substitution" (16 dependent row steps).
    stack: A_kk and A_qk as one product of the stacked rows [k; q] (fewer registers: 167 a thread
        against 181) or as two.
    num_warps: warps per program.
    maxnreg: caps the kernel's registers a thread (None: the compiler's choice). At 4 warps
        an SM holds 2 programs above 168 registers, 3 up to 168 and 4 up to 128 (the default
        config needs 167; "tf32x3" 216, tiles=4 254; "tf32" and "ieee" 126 and 128).

    Register counts are from the sm90 compile (K = V = 128, bf16) with Triton 3.6, the H200 image's;
    Triton 3.9 gives about the same for the default.
    """

    heads: int = 1
    tiles: int = 1
    precision: str = "bf16x3"
    wu_precision: str | None = None
    inverse: str = "doubling"
    stack: bool = True
    num_warps: int = 4
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS or self.wu_precision not in (None, *PRECISIONS):
            raise ValueError(
                f"IntraConfig.precision / wu_precision: one of {PRECISIONS}, not "
                f"{self.precision!r} / {self.wu_precision!r}"
            )
        if self.inverse not in ("doubling", "substitution"):
            raise ValueError(f"IntraConfig.inverse: 'doubling' or 'substitution', not {self.inverse!r}")
        if self.tiles < 1:
            raise ValueError(f"IntraConfig.tiles must be positive, not {self.tiles}")
        if self.heads < 1 or self.heads & (self.heads - 1):
            raise ValueError(f"IntraConfig.heads must be a power of 2, not {self.heads}")


@dataclass(frozen=True)
class IntraTerms:
    """`_dense_intra_kernel`'s results: w, q exp(G) scale, k exp(G_C - G) [B, T, H, K] and u [B, T, H, V]
    in the scan's operand dtype; A_qk rows [B, T, H, 16] and tile decays [tiles, H, K] in float32."""

    w: torch.Tensor
    qd: torch.Tensor
    kd: torch.Tensor
    u: torch.Tensor
    aqk: torch.Tensor
    decay: torch.Tensor
    precision: str  # the scan's tl.dot input_precision


def intra_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    tiles: TileTables,
    config: IntraConfig | None = None,
) -> IntraTerms:
    """Every tile's state-independent terms (step 1 of the module docstring); its own function so
    the bench can time it apart from the scan."""
    config = config or IntraConfig()
    B, T, H, K = q.shape
    V = v.shape[-1]
    device = q.device
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    # Operand dtype of the scan's matmuls: 16-bit inputs keep 16-bit operands (fp32 accumulation).
    work = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    w = torch.empty(B, T, H, K, dtype=work, device=device)
    qd, kd = torch.empty_like(w), torch.empty_like(w)
    u = torch.empty(B, T, H, V, dtype=work, device=device)
    aqk = torch.empty(B, T, H, TILE, dtype=torch.float32, device=device)
    num_tiles = tiles.start.numel()
    decay = torch.empty(num_tiles, H, K, dtype=torch.float32, device=device)
    if num_tiles:
        # fp32 inputs: IEEE products (a correctness path); 16-bit: the config's tensor-core mode.
        precision = "ieee" if work == torch.float32 else config.precision
        wu_precision = "ieee" if work == torch.float32 else config.wu_precision or config.precision
        NH = min(config.heads, triton.next_power_of_2(H))
        _dense_intra_kernel[(triton.cdiv(num_tiles, config.tiles) * triton.cdiv(H, NH),)](
            q, k, v, g, beta, tiles.start, tiles.end, w, u, qd, kd, aqk, decay, scale, num_tiles, H, K, V,
            NH=NH, TILES=config.tiles, BK=_block_k(K), BV=max(16, triton.next_power_of_2(V)), SHIFT=SHIFT,
            MAX_DECAY=MAX_TILE_LOG_DECAY, PRECISION=precision, WU_PRECISION=wu_precision,
            INVERSE=config.inverse, STACK=config.stack, EMULATE=not q.is_cuda,
            num_warps=config.num_warps, num_stages=1,
            **({} if config.maxnreg is None else {"maxnreg": config.maxnreg}),
        )  # fmt: skip
    # fp32 inputs get IEEE fp32 products in the scan (not TF32's 10-bit mantissa); for 16-bit
    # operands the setting is moot.
    precision = "ieee" if work == torch.float32 or not q.is_cuda else "tf32"
    return IntraTerms(w, qd, kd, u, aqk, decay, precision)


def _default_block_v(V: int, operand_dtype: torch.dtype) -> int:
    """From sm90 compiles (register counts), not yet timed; `bench/kda_fwd_gpu.py --sweep` times the
    alternatives. 16-bit operands: 64, where at K = 128 the scan's products become Hopper warp-group
    MMAs with the state split over the 4 warps by rows, and at ~230 registers a thread two programs
    fit an SM, so B=1 H=96's 192 programs run in one wave (at 32, 384 programs of ~180 registers
    would need two). float32 operands (IEEE products, a correctness path, not tuned): 16, the
    block that spills least."""
    widest = 16 if operand_dtype == torch.float32 else 64
    return min(widest, max(16, triton.next_power_of_2(V)))


def _scan_prefetch(prefetch: int | None) -> int:
    """The scan's PREFETCH distance (tiles ahead): 0 (the default: the GPU-tested first version,
    until the sweep has timed 1), 1 or 2. In the sm90 compile
    (Triton 3.9) 2 stops the loop's pipelining of w, q, k and A_qk altogether (plain loads, no
    shared-memory stages, at any num_stages), so it is for the sweep only."""
    return 0 if prefetch is None else min(max(int(prefetch), 0), 2)


def _block_k(K: int) -> int:
    return max(16, triton.next_power_of_2(K))
