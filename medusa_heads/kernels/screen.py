"""The target's greedy token at each tree node without its whole LM head in fp32.

A greedy verify needs one thing from the LM head: the argmax of each node's logits. In fp32 that product reads the
whole (V, H) weight, a tenth of SmolLM2-135M's step (49,152 x 576: 113 MB, 4.8 ms for a 6-token verify here). A
screen reads it in bf16 instead (2.3 ms through oneDNN's bf16 kernels) and proves which tokens can still be the
argmax of the logits that the model's own fp32 product would give:

    s_v = bf16(bf16(h) . bf16(w_v))   (oneDNN: exact bf16 products summed in fp32, the sum rounded to bf16)
    |s_v - z_v| <= |hb| (r_v + g |wb_v|) + |h - hb| |w_v| + g |h| |w_v| + u |s_v| / (1 - u)  =: B_v

where z_v is the fp32 logit any summation order gives (each within g = K eps / (1 - K eps) of Cauchy-Schwarz's
|h| |w_v| of the exact dot product, K = H, eps = 2^-24), hb = bf16(h), wb_v = bf16(w_v), r_v = |w_v - wb_v|, and
u = 2^-8 is bf16's rounding of the output. The model's argmax v* then satisfies s_v* + B_v* >= s_t - B_t for
t = argmax s, so every other token is ruled out. Where one candidate is left it is v*; where several are, they are
scored again in fp32, and the best wins when its margin over each other candidate exceeds both their fp32 error
bounds (2 g sum_i |h_i| |w_vi| each); where it does not (a near or exact tie), that row's logits come from the model's
own LM head, as in generate. So the choice is the model's argmax with no assumption beyond IEEE rounding and fp32
accumulation in the kernels. On SmolLM2's greedy answers: 1.6 candidates a node, 40% of nodes scored again, the
model's head for one node in 200 (one verify in 27).

Used only where it pays and is sure to apply: an fp32 LM head without bias on a CPU with bf16 kernels, in a model
whose logits are exactly its LM head applied to its decoder's output (checked once on the model itself; a model that
scales or caps its logits fails the check and keeps its own head)."""
from __future__ import annotations

import threading

import torch
from torch import nn

from medusa_heads.kernels.prepack import bf16_supported

EPS32 = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-8  # bf16 unit roundoff
SAFETY = 1.0 + 2.0**-10  # covers the rounding of the bound's own fp32 arithmetic (a few ulps)
RHO = SAFETY * U16 / (1.0 - U16)  # |s - its sum before rounding to bf16| <= RHO |s|
TOP = 32  # scores examined one by one; the rest are bounded together


class ArgmaxScreen:
    """argmax(h @ weight.T) for rows of h, through a bf16 screen of `weight` (see the module's docstring).
    `head(h)` must compute the model's own logits for the rows that need them (its LM head)."""

    def __init__(self, weight: torch.Tensor, head) -> None:
        w = weight.detach()
        if w.dtype != torch.float32 or w.dim() != 2:
            raise ValueError(f"the screen serves an fp32 (V, H) LM-head weight, got {w.dtype} {tuple(w.shape)}")
        self.weight, self.head = w, head
        k = w.shape[1]
        self.g = k * EPS32 / (1.0 - k * EPS32)
        wb = w.to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(wb, 8)
        # per token: the bound's coefficients of |hb|, |h - hb| and |h| (rows of a (3, V) product with those norms),
        # in float64 a block of rows at a time (a whole float64 copy of a large vocabulary's head would be GBs)
        blocks = []
        for a in range(0, w.shape[0], 8192):
            w64, wb64 = w[a : a + 8192].double(), wb[a : a + 8192].double()
            w_norm = w64.norm(dim=1)
            blocks.append(torch.stack([(w64 - wb64).norm(dim=1) + self.g * wb64.norm(dim=1), w_norm, self.g * w_norm]))
        self.coef = (torch.cat(blocks, dim=1) * SAFETY).float()
        self.coef_max = self.coef.max(dim=1).values  # (3,)

    @torch.no_grad()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: (N, H) fp32 LM-head inputs -> (N,) each row's argmax of the model's logits."""
        hb = h.to(torch.bfloat16)
        s = torch.ops.mkldnn._linear_pointwise(hb, self.packed, None, "none", [], "")  # (N, V) in bf16
        h64, hb64 = h.double(), hb.double()
        norms = torch.stack([hb64.norm(dim=1), (h64 - hb64).norm(dim=1), h64.norm(dim=1)], dim=1).float() * SAFETY
        if not bool(torch.isfinite(norms).all()):
            return self.head(h).argmax(dim=-1)  # nothing to prove with: the model's own logits
        # the few best scores and their exact bounds; every other token is bounded at once, since x + u|x| grows
        # with x: s_v + B_v <= f(k-th best score) + the row's largest coefficient terms
        vals, ids = s.topk(min(TOP, s.shape[1]), dim=-1)  # (N, k)
        vals = vals.float()
        bound = torch.einsum("nc,cnk->nk", norms, self.coef[:, ids]) + vals.abs() * RHO
        floor = vals[:, 0] - bound[:, 0]  # s_t - B_t: the model's maximum is at least this
        if not bool(torch.isfinite(floor).all()):
            return self.head(h).argmax(dim=-1)
        if vals.shape[1] < s.shape[1]:
            rest = vals[:, -1] + vals[:, -1].abs() * RHO + norms @ self.coef_max  # >= s_v + B_v past the top k
        else:
            rest = torch.full_like(floor, -torch.inf)  # the top k are every token
        sure = rest < floor  # no candidate past the row's top k; the other rows are screened whole below
        rows, cols = (vals + bound >= floor[:, None]).logical_and_(sure[:, None]).nonzero(as_tuple=True)
        cols = ids[rows, cols]
        wide = (~sure).nonzero()[:, 0]
        if wide.numel():  # rare: more than TOP candidates may be in these rows
            sw = s[wide].float()
            more_rows, more_cols = (sw + (norms[wide] @ self.coef + sw.abs() * RHO)
                                    >= floor[wide, None]).nonzero(as_tuple=True)
            rows, cols = torch.cat([rows, wide[more_rows]]), torch.cat([cols, more_cols])
        return self._settle(h, ids[:, 0], rows, cols)

    def _settle(self, h: torch.Tensor, top: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row's choice among its candidates (rows[i], ids[i]): the one where there is one (the row's best
        score, `top`), else the best of them scored again in fp32 where its margin proves it, else the model's own
        head's."""
        n = h.shape[0]
        count = torch.bincount(rows, minlength=n)
        if bool((count == 1).all()):
            return top.clone()
        many = count[rows] > 1
        rows, ids = rows[many], ids[many]
        past_ids = int(ids.max()) + 1
        hr, wr = h[rows], self.weight[ids]
        z = torch.einsum("kh,kh->k", hr, wr)  # fp32 again, in another order than the model's
        err = 2.0 * self.g * SAFETY * torch.einsum("kh,kh->k", hr.abs(), wr.abs())  # |z - the model's z| <= err
        best = torch.full((n,), -torch.inf, device=h.device).scatter_reduce(0, rows, z, "amax")
        first = torch.full((n,), past_ids, device=h.device).scatter_reduce(
            0, rows, torch.where(z == best[rows], ids, past_ids), "amin")  # argmax's choice: the lowest id of the best
        winner = ids == first[rows]
        win_err = torch.zeros(n, device=h.device).scatter(0, rows[winner], err[winner])
        # every other candidate stays below the winner whichever order the model sums in
        sure = winner | (z + err < (best - win_err)[rows])
        choice = torch.where(count > 1, first, top)
        for r in rows[~sure].unique().tolist():  # a near or exact tie: the model's own logits decide, as in generate
            choice[r] = self.head(h[r : r + 1]).argmax(dim=-1)[0]
        return choice


class ScreenCache:
    """A model's screen, built on first use and again when its LM-head weight changes; None where it does not
    apply (see the module's docstring). Shared by every thread that decodes with the model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.enabled = True  # False: the full LM head at every verify (for comparisons)
        self._lock = threading.Lock()
        self._key, self._screen = None, None
        self.decoder = None  # the model's decoder (its forward up to the LM head's input), where the screen serves

    def get(self) -> ArgmaxScreen | None:
        if not self.enabled:
            return None
        head = self.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is None:
            return None
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if key != self._key:
            with self._lock:
                if key != self._key:
                    self._screen, self.decoder = _build(self.model, head) if _applies(head) else (None, None)
                    self._key = key
        return self._screen


def _applies(head: nn.Module) -> bool:
    weight = head.weight
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and getattr(head, "bias", None) is None and bf16_supported())


@torch.no_grad()
def _build(model: nn.Module, head: nn.Module) -> tuple[ArgmaxScreen | None, nn.Module | None]:
    """(the screen, the decoder) if the model's logits are exactly its LM head over its decoder's output (checked
    on two tokens), else (None, None)."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    if decoder is None or decoder is model:
        return None, None
    ids = torch.tensor([[1, 2]], device=head.weight.device)
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0]
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
    except (TypeError, AttributeError, ValueError):
        return None, None
    if hidden.shape[-1] != head.weight.shape[1] or not torch.equal(head(hidden), logits):
        return None, None
    return ArgmaxScreen(head.weight, head), decoder
