"""Context-parallel entmax attention (entmax_fast.distributed) on real gloo process groups
of 2 and 4 CPU processes: every rank's output and gradients equal its rows of the
single-process op on the whole sequence, for both methods and layouts, causal or not,
GQA, tensor α, masks and the score options; models train under ``context_parallel`` with
the single process's loss and gradients; bad inputs raise named errors on every rank.

Spawning is slow, so each group size is spawned once (a module fixture) and its workers run
every check in turn, recording each check's failure by name; the tests read those records."""
import importlib
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import entmax_fast
from entmax_fast import distributed as cp
from entmax_fast.multihead import MultiheadEntmaxAttention

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch built without gloo")

# A worker group that has not finished by then is hung (a collective waiting on a rank
# that raised): the test fails instead of blocking.
GROUP_TIMEOUT_S = 240
OUT_TOL = {"atol": 1e-5, "rtol": 0}
GRAD_TOL = {"atol": 1e-4, "rtol": 0}
# Float64 models: the context-parallel step sums the same terms in another order.
MODEL_TOL = {"atol": 1e-10, "rtol": 1e-8}

METHODS = ("all_to_all", "all_gather")
LAYOUTS = ("balanced", "contiguous")


def _sizes(world_size):
    """(B, H, Hkv, L, E): GQA with H and Hkv divisible by P, L divisible by 2P."""
    return (2, 4, 2, 16, 8) if world_size == 2 else (1, 8, 4, 32, 8)


def _inputs(world_size, seed=0):
    batch, heads, kv_heads, length, dim = _sizes(world_size)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=generator)
    k = torch.randn(batch, kv_heads, length, dim, generator=generator)
    v = torch.randn(batch, kv_heads, length, dim, generator=generator)
    grad_out = torch.randn(batch, heads, length, dim, generator=generator)
    alpha = torch.linspace(1.2, 2.0, heads)
    return q, k, v, grad_out, alpha


def _leaf(x):
    return x.detach().clone().requires_grad_()


def _compare_attention(layout, method, *, params=(), **kwargs):
    """Runs entmax_attention on the whole sequence and context_parallel_attention on this
    rank's shards with the same arguments; compares the output, dq, dk, dv (this rank's
    rows) and the gradients of ``params`` (names of kwargs: tensors replicated on every
    rank, whose gradients summed over the ranks must equal the single-process ones)."""
    world_size = dist.get_world_size()
    q, k, v, grad_out, alpha = _inputs(world_size)
    kwargs.setdefault("alpha", alpha)
    kwargs.setdefault("enable_gqa", True)
    mask = kwargs.pop("attn_mask", None)
    full = {name: _leaf(value) if name in params else value for name, value in kwargs.items()}
    leaves = [_leaf(x) for x in (q, k, v)]
    out = entmax_fast.entmax_attention(*leaves, attn_mask=mask, **full)
    want = torch.autograd.grad((out * grad_out).sum(), [*leaves, *(full[name] for name in params)])

    def local(x):
        return cp.shard(x, layout=layout)

    mine = {name: _leaf(value) if name in params else value for name, value in kwargs.items()}
    local_leaves = [_leaf(local(x)) for x in (q, k, v)]
    local_mask = None if mask is None else (local(mask) if mask.shape[2] > 1 else mask)
    if isinstance(local_mask, torch.Tensor) and "attn_mask" in params:
        local_mask = _leaf(local_mask)
    got_out = cp.context_parallel_attention(*local_leaves, attn_mask=local_mask, layout=layout, method=method,
                                            **mine)
    torch.testing.assert_close(got_out, local(out), **OUT_TOL)
    got = torch.autograd.grad((got_out * local(grad_out)).sum(), [*local_leaves, *(mine[name] for name in params)])
    for name, grad, expected in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(grad, local(expected), **GRAD_TOL, msg=lambda m: f"{name}: {m}")
    for name, grad, expected in zip(params, got[3:], want[3:]):
        summed = grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, expected, **GRAD_TOL, msg=lambda m: f"d{name} summed over ranks: {m}")
        assert expected.abs().max() > 1e-3, f"d{name} is ~0: the check would not see a missing share"


def _attention_checks():
    checks = {}
    for method in METHODS:
        for layout in LAYOUTS:
            for causal in (True, False):
                name = f"attention-{method}-{layout}-{'causal' if causal else 'full'}"
                checks[name] = (lambda layout=layout, method=method, causal=causal:
                                _compare_attention(layout, method, is_causal=causal, params=("alpha",)))
        checks[f"float_alpha-{method}"] = (lambda method=method:
                                           _compare_attention("balanced", method, is_causal=True, alpha=2.0))
        checks[f"bool_mask-{method}"] = lambda method=method: _bool_mask(method)
        checks[f"float_mask_per_head-{method}"] = lambda method=method: _float_mask_per_head(method)
        checks[f"score_options_causal-{method}"] = lambda method=method: _score_options_causal(method)
        checks[f"causal_bias-{method}"] = lambda method=method: _causal_bias(method)
    checks["score_options_bidirectional-all_to_all"] = _score_options_bidirectional
    checks["auto-method"] = _auto_method
    checks["shard_unshard"] = _shard_unshard
    return checks


def _bool_mask(method):
    """A padding-like mask shared by the heads (B, 1, L, L), with the causal flag."""
    world_size = dist.get_world_size()
    batch, _, _, length, _ = _sizes(world_size)
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(batch, 1, length, length, generator=generator) > 0.3
    _compare_attention("balanced", method, is_causal=True, attn_mask=mask, params=("alpha",))


def _float_mask_per_head(method):
    """An additive mask per head (B, H, L, L) that is learned: its gradient is per rank's rows."""
    world_size = dist.get_world_size()
    batch, heads, _, length, _ = _sizes(world_size)
    generator = torch.Generator().manual_seed(2)
    mask = torch.randn(batch, heads, length, length, generator=generator)
    _compare_mask_gradient(method, mask)


def _compare_mask_gradient(method, mask):
    world_size = dist.get_world_size()
    q, k, v, grad_out, alpha = _inputs(world_size)
    full_mask = _leaf(mask)
    out = entmax_fast.entmax_attention(q, k, v, attn_mask=full_mask, enable_gqa=True, alpha=alpha)
    (want,) = torch.autograd.grad((out * grad_out).sum(), [full_mask])
    local_mask = _leaf(cp.shard(mask))
    got_out = cp.context_parallel_attention(*(cp.shard(x) for x in (q, k, v)), attn_mask=local_mask,
                                            enable_gqa=True, alpha=alpha, method=method)
    torch.testing.assert_close(got_out, cp.shard(out), **OUT_TOL)
    (got,) = torch.autograd.grad((got_out * cp.shard(grad_out)).sum(), [local_mask])
    torch.testing.assert_close(got, cp.shard(want), **GRAD_TOL)


def _score_options_causal(method):
    """A causal sliding window given as window_size=(3, 0) alone, softcap, ALiBi and
    learnable sinks, on the whole sequence's positions."""
    heads = _sizes(dist.get_world_size())[1]
    _compare_attention("balanced", method, window_size=(3, 0), softcap=2.0,
                       alibi_slopes=entmax_fast.alibi_slopes(heads), sinks=torch.linspace(-1.0, 1.0, heads),
                       params=("alpha", "sinks"))


def _score_options_bidirectional():
    heads = _sizes(dist.get_world_size())[1]
    _compare_attention("balanced", "all_to_all", window_size=(2, 3), alibi_slopes=entmax_fast.alibi_slopes(heads))
    _compare_attention("contiguous", "auto", window_size=(2, 3))


def _causal_bias(method):
    from torch.nn.attention.bias import causal_lower_right

    world_size = dist.get_world_size()
    length = _sizes(world_size)[3]
    q, k, v, _, alpha = _inputs(world_size)
    want = entmax_fast.entmax_attention(q, k, v, is_causal=True, enable_gqa=True, alpha=alpha)
    got = cp.context_parallel_attention(*(cp.shard(x) for x in (q, k, v)), causal_lower_right(length, length),
                                        enable_gqa=True, alpha=alpha, method=method)
    torch.testing.assert_close(got, cp.shard(want), **OUT_TOL)


def _auto_method():
    """The rule: fewer bytes moved (all_to_all iff H + Hkv <= P·Hkv), the all-gather when
    the heads do not divide or a mask is given, the all-to-all for whole rows; and auto runs
    exactly where all_to_all could not (H not divisible by P)."""
    world_size = dist.get_world_size()
    choose = cp._choose_method
    assert choose(8, 8, world_size, False, False) == "all_to_all"
    assert choose(8, 1, world_size, False, False) == "all_gather"
    assert choose(8, 2, 4, False, False) == "all_gather"
    assert choose(16, 8, 4, False, False) == "all_to_all"
    assert choose(8, 8, world_size, True, False) == "all_gather"
    assert choose(8, 8, world_size, True, True) == "all_to_all"
    assert choose(6, 3, 4, False, True) is None
    q, k, v, grad_out, _ = _inputs(world_size)
    q, k, v = q[:, :3], k[:, :1], v[:, :1]
    want = entmax_fast.entmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = cp.context_parallel_attention(*(cp.shard(x) for x in (q, k, v)), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, cp.shard(want), **OUT_TOL)


def _shard_unshard():
    world_size, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * 4 * world_size * 3, dtype=torch.float64).view(2, 4 * world_size, 3)
    chunk = 2
    expected_balanced = torch.cat([x[:, rank * chunk:(rank + 1) * chunk],
                                   x[:, (2 * world_size - 1 - rank) * chunk:(2 * world_size - rank) * chunk]], 1)
    assert torch.equal(cp.shard(x, seq_dim=1), expected_balanced)
    assert torch.equal(cp.shard(x, seq_dim=1, layout="contiguous"), x[:, rank * 2 * chunk:(rank + 1) * 2 * chunk])
    for layout in LAYOUTS:
        local = _leaf(cp.shard(x, seq_dim=-2, layout=layout))
        whole = cp.unshard(local, seq_dim=1, layout=layout)
        assert torch.equal(whole, x)
        weights = torch.arange(x.numel(), dtype=x.dtype).view_as(x)
        (grad,) = torch.autograd.grad((whole * weights).sum(), [local])
        # Every rank used the whole tensor: this rank's shard got P times its weights.
        torch.testing.assert_close(grad, world_size * cp.shard(weights, seq_dim=1, layout=layout))


# ---------------------------------------------------------------------------------------
# Host synchronisation: the shapes are compared across ranks once per context_parallel
# block (or when asked), not on every call.

def _shape_checks_across_ranks():
    """all_gather calls made by all-to-all attention calls, whose own collectives are
    all_to_all_single only: each one counted is a comparison of the shapes across ranks."""
    calls = []
    original = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    q, k, v, _, _ = _inputs(dist.get_world_size())
    q, k, v = (cp.shard(x) for x in (q, k, v))
    dist.all_gather = counting
    try:
        for _ in range(3):
            cp.context_parallel_attention(q, k, v, is_causal=True, enable_gqa=True, method="all_to_all")
        direct = len(calls)
        cp.context_parallel_attention(q, k, v, is_causal=True, enable_gqa=True, method="all_to_all",
                                      check_across_ranks=True)
        asked = len(calls) - direct
        with cp.context_parallel(method="all_to_all"):
            for _ in range(3):
                cp.current_attention()(q, k, v, is_causal=True, enable_gqa=True)
        in_block = len(calls) - direct - asked
        with cp.context_parallel(method="all_to_all"):
            cp.current_attention()(q, k, v, is_causal=True, enable_gqa=True)
        next_block = len(calls) - direct - asked - in_block
    finally:
        dist.all_gather = original
    assert (direct, asked, in_block, next_block) == (0, 1, 1, 1), (direct, asked, in_block, next_block)


# ---------------------------------------------------------------------------------------
# Bad input: every rank raises the same error (no hang).

def _expect_error(error, text, call):
    try:
        call()
    except error as caught:
        assert text in str(caught), f"message {str(caught)!r} lacks {text!r}"
    else:
        raise AssertionError(f"no {error.__name__} raised (expected one mentioning {text!r})")


def _error_checks():
    def shards(world_size, heads=4, kv_heads=2, length_per_rank=4):
        return (torch.randn(1, heads, length_per_rank, 8), torch.randn(1, kv_heads, length_per_rank, 8),
                torch.randn(1, kv_heads, length_per_rank, 8))

    def unequal_lengths():
        q, k, v = shards(0, length_per_rank=4 + 2 * dist.get_rank())
        _expect_error(ValueError, "query must have the same shape on every rank",
                      lambda: cp.context_parallel_attention(q, k, v, enable_gqa=True, check_across_ranks=True))
        with cp.context_parallel():
            _expect_error(ValueError, "query must have the same shape on every rank",
                          lambda: cp.current_attention()(q, k, v, enable_gqa=True))

    def is_causal_not_bool():
        q, k, v = shards(0)
        _expect_error(TypeError, "is_causal must be a bool",
                      lambda: cp.context_parallel_attention(q, k, v, None, 0.0, 0.125, enable_gqa=True))

    def heads_not_divisible():
        q, k, v = shards(0, heads=3, kv_heads=3)
        _expect_error(ValueError, "method='all_to_all' needs the query heads H (3)",
                      lambda: cp.context_parallel_attention(q, k, v, method="all_to_all"))

    def length_not_divisible():
        chunks = 2 * dist.get_world_size()
        x = torch.randn(1, 2, chunks + 1, 4)
        _expect_error(ValueError, f"must be divisible by {chunks} for layout='balanced'", lambda: cp.shard(x))

    def odd_balanced_shard():
        q, k, v = shards(0, length_per_rank=3)
        _expect_error(ValueError, "must be even for layout='balanced'",
                      lambda: cp.context_parallel_attention(q, k, v, enable_gqa=True))

    def dropout():
        q, k, v = shards(0)
        _expect_error(ValueError, "dropout_p must be 0",
                      lambda: cp.context_parallel_attention(q, k, v, dropout_p=0.1, enable_gqa=True))

    def device_the_group_cannot_use():
        q, k, v = (x.to("meta") for x in shards(0))
        _expect_error(ValueError, "query is on meta, which the process group's 'gloo' backend cannot use",
                      lambda: cp.context_parallel_attention(q, k, v, enable_gqa=True))

    def local_mask_shape():
        q, k, v = shards(0)
        mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
        _expect_error(ValueError, "attn_mask must be this rank's rows of the whole sequence's mask",
                      lambda: cp.context_parallel_attention(q, k, v, mask, enable_gqa=True))

    def bidirectional_window_on_all_gather():
        q, k, v = shards(0)
        _expect_error(ValueError, "method='all_gather' takes window_size and alibi_slopes only with causal",
                      lambda: cp.context_parallel_attention(q, k, v, enable_gqa=True, window_size=(2, 2),
                                                            method="all_gather"))

    def unknown_names():
        q, k, v = shards(0)
        _expect_error(ValueError, "method must be one of",
                      lambda: cp.context_parallel_attention(q, k, v, method="ring"))
        _expect_error(ValueError, "layout must be one of", lambda: cp.shard(q, layout="zigzag"))
        _expect_error(ValueError, "seq_dim must be an int", lambda: cp.shard(q, seq_dim=4))

    def need_weights_under_context():
        attention = MultiheadEntmaxAttention(8, 2, batch_first=True)
        x = torch.randn(1, 4, 8)
        with cp.context_parallel():
            _expect_error(ValueError, "pass need_weights=False", lambda: attention(x, x, x))

    return {f"error-{fn.__name__}": fn for fn in (unequal_lengths, is_causal_not_bool, heads_not_divisible,
                                                 length_not_divisible,
                                                 odd_balanced_shard, dropout, device_the_group_cannot_use,
                                                 local_mask_shape, bidirectional_window_on_all_gather, unknown_names,
                                                 need_weights_under_context)}


# ---------------------------------------------------------------------------------------
# Models under the context manager: one training step equals the single process's.

class _TinyCausalModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attention = MultiheadEntmaxAttention(8, 2, batch_first=True, attention="learned", alpha_init=1.4,
                                                  sinks=True, dtype=torch.float64)
        self.readout = nn.Linear(8, 1, dtype=torch.float64)

    def forward(self, x):
        hint = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        out, _ = self.attention(x, x, x, attn_mask=hint, is_causal=True, need_weights=False)
        return self.readout(out).squeeze(-1)


def _step_gradients(model, loss, *, sum_over_ranks):
    """The loss and each parameter's gradient, summed over the ranks (as DDP would) for a
    context-parallel step, whose loss on each rank is its tokens' part."""
    grads = torch.autograd.grad(loss, list(model.parameters()))
    if sum_over_ranks:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        for grad in grads:
            dist.all_reduce(grad)
    return loss.detach(), dict(zip((name for name, _ in model.named_parameters()), grads))


def _compare_steps(single, parallel):
    (want_loss, want), (got_loss, got) = single, parallel
    torch.testing.assert_close(got_loss, want_loss, **MODEL_TOL)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **MODEL_TOL, msg=lambda m: f"{name}: {m}")


def _multihead_training_step(layout):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4 * dist.get_world_size(), 8, generator=generator, dtype=torch.float64)
    target = torch.randn(2, x.shape[1], generator=generator, dtype=torch.float64)
    model = _TinyCausalModel()

    def loss_of(prediction, target):
        return ((prediction - target) ** 2).sum() / target.new_tensor(float(x.shape[:2].numel()))

    single = _step_gradients(model, loss_of(model(x), target), sum_over_ranks=False)
    with cp.context_parallel(layout=layout):
        local = cp.shard(x, seq_dim=1, layout=layout)
        parallel = _step_gradients(model, loss_of(model(local), cp.shard(target, seq_dim=1, layout=layout)),
                                   sum_over_ranks=True)
    _compare_steps(single, parallel)


def _llama_training_step(layout):
    import transformers

    import entmax_fast.hf  # noqa: F401  (registers the "entmax" implementation)

    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    model.set_attn_implementation("entmax")
    length = 8 * dist.get_world_size()
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 61, (2, length), generator=generator)
    positions = torch.arange(length).expand(2, -1)
    # Next-token labels shifted over the whole sequence, so that a shard's last token is
    # scored against the next shard's first.
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    count = (labels != -100).sum()

    def loss_of(logits, labels):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                           reduction="sum") / count

    single = _step_gradients(model, loss_of(model(input_ids=ids, position_ids=positions).logits, labels),
                            sum_over_ranks=False)
    with cp.context_parallel(layout=layout):
        local = {name: cp.shard(tensor, seq_dim=1, layout=layout)
                 for name, tensor in (("input_ids", ids), ("position_ids", positions))}
        logits = model(**local).logits
        local_labels = cp.shard(labels, seq_dim=1, layout=layout)
        parallel = _step_gradients(model, loss_of(logits, local_labels), sum_over_ranks=True)
    _compare_steps(single, parallel)


def _model_checks(world_size):
    checks = {f"multihead-{layout}": (lambda layout=layout: _multihead_training_step(layout)) for layout in LAYOUTS}
    if world_size == 2:
        checks.update({f"llama-{layout}": (lambda layout=layout: _llama_training_step(layout))
                       for layout in LAYOUTS})
    return checks


def _checks(world_size):
    return {**_attention_checks(), "shape-checks-across-ranks": _shape_checks_across_ranks, **_error_checks(),
            **_model_checks(world_size)}


# ---------------------------------------------------------------------------------------
# Running the groups

def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    # Imported before the group exists: torch 2.13's torch._dynamo, imported while a group
    # exists (the first optimizer imports it), keeps references to it past
    # destroy_process_group(), so that gloo's threads live into interpreter shutdown, where
    # one that frees a tensor aborts the process ("terminate called without an active
    # exception").
    importlib.import_module("torch._dynamo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    failures = {}
    try:
        for name, check in _checks(world_size).items():
            try:
                check()
            except Exception:  # recorded by name; the test of that name reports it
                failures[name] = traceback.format_exc(limit=6)
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as file:
            json.dump(failures, file)
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_group(world_size, out_dir) -> dict:
    """{check name: failure text of the first rank that failed it} for one spawned group."""
    context = mp.spawn(_worker, args=(world_size, _free_port(), str(out_dir)), nprocs=world_size, join=False)
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world_size}-process group did not finish within {GROUP_TIMEOUT_S} s (a hang)")
    failures = {}
    for rank in reversed(range(world_size)):
        with open(out_dir / f"{rank}.json") as file:
            failures.update({name: f"rank {rank}:\n{text}" for name, text in json.load(file).items()})
    return failures


@pytest.fixture(scope="module")
def group_failures(tmp_path_factory):
    return {world_size: _run_group(world_size, tmp_path_factory.mktemp(f"group{world_size}"))
            for world_size in (2, 4)}


# One pytest-xdist worker runs them all (scripts/test.sh distributes by group), so that the
# groups are spawned once per run rather than once per worker.
@pytest.mark.xdist_group("context_parallel_groups")
@pytest.mark.parametrize("world_size,check", [(world_size, name) for world_size in (2, 4)
                                              for name in _checks(world_size)])
def test_context_parallel(group_failures, world_size, check):
    failure = group_failures[world_size].get(check)
    assert failure is None, f"{check} on {world_size} ranks failed on {failure}"


# ---------------------------------------------------------------------------------------
# Without a process group

def test_import_is_lazy_and_initialises_nothing():
    script = ("import sys, torch.distributed as dist, entmax_fast\n"
              "assert 'entmax_fast.distributed' not in sys.modules\n"
              "import entmax_fast.distributed\n"
              "assert not dist.is_initialized()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_example_runs_under_torchrun():
    """examples/context_parallel.py checks its first step's loss against one process's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(root, "examples", "context_parallel.py"), "--steps", "2", "--length", "32"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=root)
    # a rank's own traceback comes before torchrun's report of the failed ranks
    first = result.stderr.find("Traceback")
    assert result.returncode == 0, result.stderr[max(0, first):][:3000] + "\n...\n" + result.stderr[-1500:]
    assert "= single-process loss" in result.stdout and "step 1: loss" in result.stdout, result.stdout


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        cp.context_parallel_attention(x, x, x)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        cp.shard(x)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        with cp.context_parallel():
            pass


def test_no_context_outside_the_block():
    assert cp.current_attention() is None
