"""Pipeline stages (dist.pipeline_stages = P): one pipelined SGD step equals one process with the whole batch and
the float64 full batch, on 2 gloo ranks (P = 2, D = 1) and on 4 (P = 2, D = 2, a 2 × 2 mesh); both schedules;
very uneven documents, a replica without a target, a partial last group; the clip of the whole model's norm;
one gradient all-reduce of each stage per update; each stage's checkpoint state under the whole model's names."""

import math

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from accumulation.batching import GlobalCounts, MicroBatch, count_supervised_tokens
from accumulation.models.gpt import GPT, GPTConfig
from accumulation.parallel.mesh import build_layout
from accumulation.parallel.pipeline import (
    build_pipeline,
    optimizer_order,
    pipelined_loss_sum,
    stage_optimizer_state,
    whole_numbers,
)
from accumulation.run.sharded_checkpoint import split_stage_payload
from accumulation.step import StepSetup, optimizer_step, token_cross_entropy_sum
from testkit.ranks import run_on_ranks
from testkit.reference import capture_gradients, float64_reference_gradient
from tests.test_step import CPU, FLOAT64_RTOL, micro_batches

MODEL = GPTConfig(seq_len=8, n_layer=3, n_head=2, d_model=16, vocab_size=256)  # 3 blocks: stages of 2 and 1

# fp32: the pipelined step and one process add the same terms in other orders (per micro-batch, then over
# replicas, versus per micro-batch on one process); rounding then differs by a few ulps of fp32 (1.2e-7)
# per term over a few hundred terms, below 1e-5 relative to the largest entry; a wrong weighting (the
# schedule's default scale_grads, a missing ×D) is off by 30% or more.
FP32_RTOL = 1e-5

# Supervised tokens per row of each micro-batch, per replica (A = 3 micro-batches of 2 rows).
CASES = {
    "very uneven": {0: [[8, 1], [0, 0], [8, 8]], 1: [[1, 0], [0, 0], [2, 0]]},
    "partial last group": {0: [[8, 2], [5, 7], [0, 0]], 1: [[3, 0], [0, 0], [0, 0]]},  # batch.tail = partial
    "a replica without targets": {0: [[3, 8], [2, 6], [8, 1]], 1: [[0, 0], [0, 0], [0, 0]]},
}


def new_model(dtype: torch.dtype) -> GPT:
    return GPT(MODEL, seed=7).to(dtype)


def case_batches(case: str, replica: int, dtype_seed: int = 0) -> list[MicroBatch]:
    return micro_batches(CASES[case][replica], seed=10 * replica + len(case) + dtype_seed)


def counts_of(batches: list[MicroBatch]) -> GlobalCounts:
    return GlobalCounts(
        sum(count_supervised_tokens(mb.labels) for mb in batches), sum(mb.num_examples for mb in batches)
    )


def counting_dp_allreduce_hook(state: dict, bucket):
    """DDP's own averaging all-reduce of one gradient bucket over the dp group, adding its bytes to state["bytes"]."""
    state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(state["group"], bucket)


def pipelined_gradient(layout, model, replica_batches, all_batches, schedule, grad_clip=0.0, **options):
    """One pipelined SGD step of this rank's stage: (the gradient handed to SGD by parameter name, the
    StepResult)."""
    pipeline = build_pipeline(model, layout, CPU, token_cross_entropy_sum, len(replica_batches), schedule)
    optimizer = torch.optim.SGD(pipeline.stage_module.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    setup = StepSetup(pipeline.stage_module, CPU, strategy=pipeline, grad_clip=grad_clip, **options)
    result = optimizer_step(setup, replica_batches, optimizer, global_counts=counts_of(all_batches))
    names = [name for group in optimizer_order(optimizer, pipeline.names) for name in group]
    handed = dict(zip(names, captured[0], strict=True)) if captured else {}
    return handed, result


def pipeline_worker(rank, world_size):
    torch.set_num_threads(1)
    layout = build_layout(CPU, pipeline_stages=2)
    replicas = range(layout.replicas)
    results = {}
    for case in CASES:
        batches = {r: case_batches(case, r) for r in replicas}
        everything = [mb for r in replicas for mb in batches[r]]
        for schedule in ("1f1b", "gpipe"):
            for dtype in (torch.float64, torch.float32):
                model = new_model(dtype)
                mine = [MicroBatch(mb.inputs, mb.labels, mb.num_examples) for mb in batches[layout.replica]]
                results[case, schedule, dtype] = pipelined_gradient(layout, model, mine, everything, schedule)
    # Clipping with the whole model's norm: a clip far below the norm.
    batches = {r: case_batches("very uneven", r) for r in replicas}
    everything = [mb for r in replicas for mb in batches[r]]
    results["clipped"] = pipelined_gradient(
        layout, new_model(torch.float64), batches[layout.replica], everything, "1f1b", grad_clip=0.05
    )
    # fp16 with a GradScaler: the step of one process; and an overflow on the last stage only (a gradient hook
    # makes one of its gradients inf): every rank skips the update and lowers its scale alike.
    fp16 = {"autocast_dtype": torch.float16}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    results["fp16"] = pipelined_gradient(
        layout, new_model(torch.float32), batches[layout.replica], everything, "1f1b", scaler=scaler, **fp16
    )
    model = new_model(torch.float32)
    model.lm_head.weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    (
        _,
        overflow,
    ) = pipelined_gradient(layout, model, batches[layout.replica], everything, "1f1b", scaler=scaler, **fp16)
    results["overflow"] = (overflow.applied, overflow.skip_reason, scaler.get_scale(), overflow.loss_scale)
    # Gradient bytes all-reduced per step by one pipeline over three steps (one replica holds no target).
    if layout.replicas > 1:
        empty_replica = {r: case_batches("a replica without targets", r) for r in replicas}
        all_rows = [mb for r in replicas for mb in empty_replica[r]]
        pipeline = build_pipeline(new_model(torch.float64), layout, CPU, token_cross_entropy_sum, 3, "1f1b")
        reduced = {"bytes": 0, "group": layout.dp_group}
        pipeline.wrapped.register_comm_hook(reduced, counting_dp_allreduce_hook)
        optimizer = torch.optim.SGD(pipeline.stage_module.parameters(), lr=0.1)
        per_step = []
        for _ in range(3):
            before = reduced["bytes"]
            optimizer_step(
                StepSetup(pipeline.stage_module, CPU, strategy=pipeline),
                empty_replica[layout.replica],
                optimizer,
                global_counts=counts_of(all_rows),
            )
            per_step.append(reduced["bytes"] - before)
        stage_bytes = sum(p.numel() * p.element_size() for p in pipeline.stage_module.parameters())
        results["bytes per step"] = (per_step, stage_bytes)
    # Validation: the forward-only pass, summed over the ranks as train.py does.
    model = new_model(torch.float64)
    pipeline = build_pipeline(model, layout, CPU, token_cross_entropy_sum, 3, "1f1b")
    loss_sum, tokens = pipelined_loss_sum(pipeline, batches[layout.replica][:2], None)
    torch.distributed.all_reduce(loss_sum)
    results["validation"] = (loss_sum.item(), tokens, layout.is_last_stage)
    # Checkpoint state: each stage's own tensors under the whole model's names and numbers (what this rank hands
    # the sharded checkpoint), and the optimizer's mapped back.
    optimizer = torch.optim.AdamW(pipeline.stage_module.parameters(), lr=0.01)
    optimizer_step(
        StepSetup(pipeline.stage_module, CPU, strategy=pipeline),
        batches[layout.replica],
        optimizer,
        global_counts=counts_of(everything),
    )
    pipeline.whole_order = optimizer_order(torch.optim.AdamW(model.parameters(), lr=0.01), pipeline.names)
    tensors, rest = split_stage_payload({"counters": {}}, pipeline, optimizer)
    results["checkpoint"] = ({key: value.clone() for key, value in tensors.items()}, rest["optimizer"])
    results["exp_avg by name"] = {pipeline.names[id(p)]: optimizer.state[p]["exp_avg"].clone() for p in optimizer.state}
    if layout.replica == 0:  # the mapping back: this stage's part of the whole state loads into this stage's optimizer
        state = {number: dict(rest["optimizer"]["state"][number]) for number in whole_numbers(pipeline, optimizer)}
        for key, value in tensors.items():
            if key.startswith("optimizer/"):
                _, number, entry = key.split("/")
                state[int(number)][entry] = value
        saved = {"state": state, "param_groups": rest["optimizer"]["param_groups"]}
        restored = torch.optim.AdamW(pipeline.stage_module.parameters(), lr=0.01)
        restored.load_state_dict(stage_optimizer_state(pipeline, restored, saved))
        results["restored"] = [restored.state[p]["exp_avg"].clone() for p in pipeline.stage_module.parameters()]
        results["original"] = [optimizer.state[p]["exp_avg"].clone() for p in pipeline.stage_module.parameters()]
    return results


def one_process_gradient(model, batches, grad_clip=0.0):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    optimizer_step(StepSetup(model, CPU, grad_clip=grad_clip), batches, optimizer)
    return dict(zip((name for name, _ in model.named_parameters()), captured[0], strict=True))


def relative_error(gradient: dict, reference: dict) -> float:
    assert gradient.keys() == reference.keys()
    largest = max(r.abs().max().item() for r in reference.values())
    return max((gradient[n].double() - reference[n].double()).abs().max().item() for n in reference) / largest


def whole_gradient(per_rank: list, key, pipeline_stages: int = 2) -> dict:
    """The stages' gradients of replica 0 joined into one gradient of the whole model."""
    joined = {}
    for rank in range(pipeline_stages):
        joined.update(per_rank[rank][key][0])
    return joined


def check_pipelined_steps(per_rank: list, replicas: int) -> None:
    world = len(per_rank)
    for case in CASES:
        everything = [mb for r in range(replicas) for mb in case_batches(case, r)]
        model64 = new_model(torch.float64)
        reference = dict(
            zip(
                (n for n, _ in model64.named_parameters()), float64_reference_gradient(model64, everything), strict=True
            )
        )
        one_process = one_process_gradient(new_model(torch.float32), everything)
        tokens = counts_of(everything).tokens
        for schedule in ("1f1b", "gpipe"):
            got64 = whole_gradient(per_rank, (case, schedule, torch.float64))
            got32 = whole_gradient(per_rank, (case, schedule, torch.float32))
            assert relative_error(got64, reference) < FLOAT64_RTOL, (case, schedule)
            assert relative_error(got32, one_process) < FP32_RTOL, (case, schedule)
            assert relative_error(got32, reference) < FP32_RTOL, (case, schedule)
            # The replicas of a stage hold the same gradient after DDP's average.
            for rank in range(world):
                handed = per_rank[rank][case, schedule, torch.float64][0]
                same_stage = per_rank[rank % 2][case, schedule, torch.float64][0]
                assert all(torch.equal(handed[n], same_stage[n]) for n in handed), (case, rank)
            # Every rank logs the same loss and counts.
            results = [per_rank[rank][case, schedule, torch.float64][1] for rank in range(world)]
            assert len({(r.loss, r.tokens, r.applied, r.grad_norm) for r in results}) == 1, case
            assert results[0].tokens == tokens and results[0].applied and results[0].micro_batches == 3


def check_grad_scaler(per_rank: list, replicas: int) -> None:
    everything = [mb for r in range(replicas) for mb in case_batches("very uneven", r)]
    optimizer = torch.optim.SGD((model := new_model(torch.float32)).parameters(), lr=0.1)
    captured = capture_gradients(optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer_step(StepSetup(model, CPU, scaler=scaler, autocast_dtype=torch.float16), everything, optimizer)
    one_process = dict(zip((name for name, _ in model.named_parameters()), captured[0], strict=True))
    # fp16 keeps 11 bits (2.4e-4 per rounding); the two runs round in other places: the checker's fp16 bound.
    assert relative_error(whole_gradient(per_rank, "fp16"), one_process) < 1e-2
    assert {per_rank[rank]["fp16"][1].loss_scale for rank in range(len(per_rank))} == {2.0**10}
    # The overflow: no rank applied, every scaler halved (backoff 0.5) from the same scale.
    assert {per_rank[rank]["overflow"] for rank in range(len(per_rank))} == {
        (False, "non-finite gradient (GradScaler lowered its scale)", 2.0**9, 2.0**10)
    }


def check_clip_and_validation(per_rank: list, replicas: int) -> None:
    everything = [mb for r in range(replicas) for mb in case_batches("very uneven", r)]
    clipped_reference = one_process_gradient(new_model(torch.float64), everything, grad_clip=0.05)
    assert relative_error(whole_gradient(per_rank, "clipped"), clipped_reference) < FLOAT64_RTOL
    # The validation loss: the token mean over the first two micro-batches of every replica, as one process.
    model = new_model(torch.float64)
    rows = [mb for r in range(replicas) for mb in case_batches("very uneven", r)[:2]]
    expected = sum(token_cross_entropy_sum(model(mb.inputs), mb.labels).item() for mb in rows)
    loss_sum, _tokens, _ = per_rank[0]["validation"]
    assert abs(loss_sum - expected) <= 1e-10 * expected


def check_checkpoint_state(per_rank: list) -> None:
    """The stages of replica 0 hand the whole model's tensors between them, under its names; the other replicas
    hand nothing; rank 0's small state and the handed moments make the state dict of one AdamW over the whole
    model, each moment under the number that optimizer gives its parameter."""
    one_process = new_model(torch.float64)
    handed = {}
    for rank, results in enumerate(per_rank):
        tensors, _ = results["checkpoint"]
        assert rank < 2 or tensors == {}, rank  # ranks 2 and 3: replica 1's copies
        assert not handed.keys() & tensors.keys()  # no tensor handed by two stages
        handed.update(tensors)
    model_names = [name[len("model/") :] for name in handed if name.startswith("model/")]
    assert sorted(model_names) == sorted(one_process.state_dict())
    optimizer_state = per_rank[0]["checkpoint"][1]  # rank 0's state.pt part
    for key, value in handed.items():
        if key.startswith("optimizer/"):
            _, number, entry = key.split("/")
            optimizer_state["state"][int(number)][entry] = value
    one_process_optimizer = torch.optim.AdamW(one_process.parameters(), lr=0.01)
    one_process_optimizer.load_state_dict(optimizer_state)  # the format of an optimizer over the whole model
    names = [name for name, _ in one_process.named_parameters()]  # that optimizer's numbering
    assert sorted(optimizer_state["state"]) == list(range(len(names)))
    exp_avg = per_rank[0]["exp_avg by name"] | per_rank[1]["exp_avg by name"]
    for number, name in enumerate(names):
        assert torch.equal(optimizer_state["state"][number]["exp_avg"], exp_avg[name]), name
    for rank in (0, 1):
        restored, original = per_rank[rank]["restored"], per_rank[rank]["original"]
        assert all(torch.equal(a, b) for a, b in zip(restored, original, strict=True))


def test_two_stages_on_two_ranks_equal_one_process_and_the_float64_full_batch():
    per_rank = run_on_ranks(pipeline_worker, world_size=2, timeout_s=300)
    check_pipelined_steps(per_rank, replicas=1)
    check_grad_scaler(per_rank, replicas=1)
    check_clip_and_validation(per_rank, replicas=1)
    check_checkpoint_state(per_rank)


def test_two_by_two_mesh_on_four_ranks_equals_the_full_batch_with_one_gradient_all_reduce_per_stage():
    per_rank = run_on_ranks(pipeline_worker, world_size=4, timeout_s=600)
    check_pipelined_steps(per_rank, replicas=2)
    check_grad_scaler(per_rank, replicas=2)
    check_clip_and_validation(per_rank, replicas=2)
    check_checkpoint_state(per_rank)
    # One all-reduce of each stage's gradient per update, on a replica without targets too, the first step
    # included: its shape inference (a forward of its own, outside the schedule's no_sync) arms no all-reduce.
    for rank in range(4):
        per_step, stage_bytes = per_rank[rank]["bytes per step"]
        assert per_step == [stage_bytes] * 3, rank
