"""The unshard executor driven by scripted all-gathers: what it sends, how it merges, what it outputs."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from tests.run.support import layout_of, spec
from workbench import _compat
from workbench.errors import PlanError
from workbench.layout import InterleavedShard
from workbench.mesh import MeshSpec
from workbench.plan.policy import SavePolicy
from workbench.plan.save_plan import HFSavePlan, plan_hf_save
from workbench.plan.schedule import schedule_unshard
from workbench.run.communicator import Communicator, drive
from workbench.run.executor import GatherRequest, WaveOutput, unshard
from workbench.run.unshard_ops import split_keys

SS = _compat.make_strided_shard
T = torch.tensor


def run_scripted(
    plans: list[HFSavePlan], local: dict[str, torch.Tensor], answer: Callable[[GatherRequest], torch.Tensor | None],
    budget: int | None = None,
) -> tuple[list[SimpleNamespace], dict[str, torch.Tensor], list[int]]:
    """Drive one rank's executor; ``answer`` plays the all-gather. Returns requests, outputs, wave order."""
    program = unshard(schedule_unshard(plans, budget_bytes=budget), plans, local)
    requests, outputs, waves = [], {}, []
    reply: Any = None
    while True:
        try:
            message = program.send(reply)
        except StopIteration:
            return requests, outputs, waves
        if isinstance(message, GatherRequest):  # its send buffer is released on resume: keep what was sent
            requests.append(SimpleNamespace(call=message.call, send=message.send, mesh_dim=message.mesh_dim))
            reply = answer(message)
        else:
            assert isinstance(message, WaveOutput)
            waves.append(message.wave)
            outputs.update(message.tensors)
            reply = None


def echo(request: GatherRequest) -> torch.Tensor:
    """Every rank sent what this rank sent."""
    return request.send.repeat(request.call.world)


def script(*per_call: list[list[float]]) -> Callable[[GatherRequest], torch.Tensor]:
    """Answer the k-th call with the concatenation of the given per-rank chunks."""
    answers = iter(per_call)

    def answer(request: GatherRequest) -> torch.Tensor:
        return torch.cat([T(chunk, dtype=request.send.dtype) for chunk in next(answers)])

    return answer


def test_one_batched_call_then_the_dependent_step_alone() -> None:
    # experts: keys k0, k1, (8,2) cut by b then by a on dim 0 (local (2,2)); gate: (4,2) cut by a (local (2,2))
    mesh = MeshSpec((2, 2), ("a", "b"))
    experts = spec("experts", ["k0", "k1"], (8, 2), mesh, [SS(0, 2), Shard(0)], fused_dim=0)
    gate = spec("gate", "gate", (4, 2), mesh, [Shard(0), Replicate()])
    plans = [plan_hf_save(experts, 0), plan_hf_save(gate, 0)]
    requests, outputs, _ = run_scripted(plans, {"experts": torch.ones(2, 2), "gate": torch.ones(2, 2)}, echo)
    assert [[i.padded_shape for i in r.call.items] for r in requests] == [[(2, 2), (2, 2)], [(4, 2)]]
    assert [r.mesh_dim for r in requests] == ["a", "b"]
    assert [r.send.numel() for r in requests] == [8, 8]
    assert {n: tuple(t.shape) for n, t in outputs.items()} == {"experts": (8, 2), "gate": (4, 2)}
    assert torch.equal(outputs["experts"], torch.ones(8, 2)) and torch.equal(outputs["gate"], torch.ones(4, 2))


def test_different_dtypes_gather_in_separate_calls() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    a = plan_hf_save(spec("a", "a", (4, 2), mesh, [Shard(0)]), 0, runtime_dtype=torch.float32)
    b = plan_hf_save(spec("b", "b", (4, 2), mesh, [Shard(0)]), 0, runtime_dtype=torch.float64)
    local = {"a": torch.ones(2, 2), "b": torch.ones(2, 2, dtype=torch.float64)}
    requests, outputs, _ = run_scripted([a, b], local, echo)
    assert [(r.call.dtype, r.send.dtype) for r in requests] == [(torch.float32,) * 2, (torch.float64,) * 2]
    assert outputs["a"].dtype == torch.float32 and outputs["b"].dtype == torch.float64


def test_uneven_contiguous_gather_pads_the_send_and_trims_the_result() -> None:
    # (5,) over 3 ranks: 2, 2, 1; rank 2 holds [4] and sends [4, 0]; the gather yields 6, trimmed to 5
    mesh = MeshSpec((3,), ("fsdp",))
    plan = plan_hf_save(spec("w", "w", (5,), mesh, [Shard(0)]), 2)
    requests, outputs, _ = run_scripted([plan], {"w": T([4.0])}, script([[0, 1], [2, 3], [4, 0]]))
    (request,) = requests
    assert torch.equal(request.send, T([4.0, 0.0]))
    assert request.call.items[0].padded_shape == (2,)
    assert torch.equal(outputs["w"], torch.arange(5.0))


def test_interleaved_gather_puts_runs_back_in_order_then_trims_fp8_padding() -> None:
    # (8,) with origin (6,), IS(0,2) over 2 ranks: rank 0 holds [0,1,4,5], rank 1 [2,3,6,7]; no padding sent
    mesh = MeshSpec((2,), ("etp",))
    plan = plan_hf_save(spec("w", "w", (8,), mesh, [InterleavedShard(0, 2)], origin_shape=(6,)), 0)
    requests, outputs, _ = run_scripted([plan], {"w": T([0.0, 1, 4, 5])}, script([[0, 1, 4, 5], [2, 3, 6, 7]]))
    assert [r.send.shape for r in requests] == [torch.Size([4])]
    assert torch.equal(outputs["w"], torch.arange(6.0))  # not the rank concatenation [0,1,4,5,2,3]


def test_preserve_ep_still_deinterleaves_etp() -> None:
    # keys k0..k3 on (8,), EP(2) then ETP(2, F=2); rank (ep=1, etp=0) holds [4, 6], its ETP peer [5, 7]
    mesh = MeshSpec((2, 2), ("ep", "etp"))
    s = spec("w", ["k0", "k1", "k2", "k3"], (8,), mesh, [Shard(0), InterleavedShard(0, 2)], fused_dim=0)
    rank = mesh.rank_at((1, 0))
    plan = plan_hf_save(s, rank, SavePolicy.preserve("ep"))
    assert plan.hf_keys == ("k2", "k3")
    requests, outputs, _ = run_scripted([plan], {"w": T([4.0, 6])}, script([[4, 6], [5, 7]]))
    assert [r.mesh_dim for r in requests] == ["etp"]
    assert torch.equal(outputs["w"], T([4.0, 5, 6, 7]))
    pieces = split_keys(outputs["w"], plan)
    assert list(pieces) == ["k2", "k3"]
    assert torch.equal(pieces["k2"], T([4.0, 5])) and torch.equal(pieces["k3"], T([6.0, 7]))


def test_gather_only_fsdp_keeps_etp_and_trims_the_local_fp8_tail() -> None:
    # (16,) with origin (14,), ETP(2, F=2) then FSDP(2); rank (fsdp=1, etp=1): ETP runs [4,8) + [12,16), FSDP
    # half 1 = [12..15]; its FSDP peer holds [4..7]. Gathering FSDP only gives [4..7, 12..15]; 14, 15 are padding.
    mesh = MeshSpec((2, 2), ("fsdp", "etp"))
    s = spec("w", "w", (16,), mesh, [SS(0, 2), InterleavedShard(0, 2)], origin_shape=(14,))
    assert s.describe_shards() == "IS(0,2)@etp -> S(0)@fsdp"
    plan = plan_hf_save(s, mesh.rank_at((1, 1)), SavePolicy.gather_only("fsdp"))
    assert plan.runtime_output_shape == (8,) and plan.output_shape == (6,)
    requests, outputs, _ = run_scripted([plan], {"w": T([12.0, 13, 14, 15])}, script([[4, 5, 6, 7], [12, 13, 14, 15]]))
    assert [r.mesh_dim for r in requests] == ["fsdp"]
    assert torch.equal(outputs["w"], T([4.0, 5, 6, 7, 12, 13]))


def test_each_wave_is_handed_out_before_the_next_one_gathers() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    plans = [plan_hf_save(spec(n, n, (8, 4), mesh, [Shard(0)]), 1) for n in ("a", "b", "c")]
    local = {n: torch.full((4, 4), float(i)) for i, n in enumerate("abc")}
    program = unshard(schedule_unshard(plans, budget_bytes=200), plans, local)  # one tensor per wave
    kinds = []
    reply: Any = None
    while True:
        try:
            message = program.send(reply)
        except StopIteration:
            break
        kinds.append(type(message).__name__ if isinstance(message, GatherRequest) else list(message.tensors))
        reply = echo(message) if isinstance(message, GatherRequest) else None
    assert kinds == ["GatherRequest", ["a"], "GatherRequest", ["b"], "GatherRequest", ["c"]]


def test_executor_casts_to_the_gather_dtype_before_sending() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    plan = plan_hf_save(spec("w", ["w.a", "w.norm"], (4, 2), mesh, [Shard(0)], fused_dim=0),
        0, runtime_dtype=torch.bfloat16, fp32_keys_pattern=r"norm"
    )
    local = torch.tensor([[1.5, 2.5], [3.5, 4.5]], dtype=torch.bfloat16)
    requests, outputs, _ = run_scripted([plan], {"w": local}, echo)
    assert requests[0].send.dtype == torch.float32
    pieces = split_keys(outputs["w"], plan)
    assert pieces["w.a"].dtype == torch.bfloat16 and pieces["w.norm"].dtype == torch.float32


def test_local_shape_mismatch_names_parameter_rank_and_shapes() -> None:
    mesh = MeshSpec((2, 2), ("fsdp", "tp"))
    plan = plan_hf_save(spec("attn.o", "o", (6, 8), mesh, [Shard(0), Shard(1)]), 3)
    program = unshard(schedule_unshard([plan]), [plan], {"attn.o": torch.zeros(3, 3)})
    with pytest.raises(PlanError, match=r"parameter 'attn.o', rank 3: local tensor has shape \(3, 3\), but the plan "
                                        r"expects \(3, 4\)"):
        next(program)


def test_a_missing_gather_answer_is_an_error() -> None:
    mesh = MeshSpec((2,), ("fsdp",))
    plan = plan_hf_save(spec("w", "w", (4,), mesh, [Shard(0)]), 0)
    program = unshard(schedule_unshard([plan]), [plan], {"w": torch.zeros(2)})
    assert isinstance(next(program), GatherRequest)
    with pytest.raises(PlanError, match="expected the gathered buffer"):
        program.send(None)


class ScriptedComm:
    """A Communicator whose all-gather pretends every peer sent ``peer_value``-filled buffers."""

    rank = 1

    def __init__(self) -> None:
        self.calls: list[tuple[Any, int]] = []

    def all_gather(self, send: torch.Tensor, mesh_dim: Any) -> torch.Tensor:
        self.calls.append((mesh_dim, send.numel()))
        return torch.cat([torch.full_like(send, 7.0), send])  # rank 0 = peer, rank 1 = me

    def any_flag(self, mesh_dim: Any, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj, obj]


def test_drive_answers_requests_through_a_communicator() -> None:
    comm = ScriptedComm()
    assert isinstance(comm, Communicator)
    mesh = MeshSpec((2,), ("fsdp",))
    plan = plan_hf_save(spec("w", "w", (4,), mesh, [Shard(0)]), 1)
    waves: list[tuple[int, dict]] = []
    drive(unshard(schedule_unshard([plan]), [plan], {"w": T([2.0, 3])}), comm,
          lambda w: waves.append((w.wave, dict(w.tensors))))
    assert comm.calls == [("fsdp", 2)]
    assert [w for w, _ in waves] == [0] and torch.equal(waves[0][1]["w"], T([7.0, 7, 2, 3]))


def test_round_trip_of_a_layout_through_scripted_peers() -> None:
    # all four ranks of a 2x2 mesh run in lock step, answering each other's gathers by hand
    mesh = MeshSpec((2, 2), ("fsdp", "tp"))
    layout = layout_of(mesh, spec("w", "w", (5, 3), mesh, [SS(0, 2), Shard(0)]))
    full = torch.arange(15.0).reshape(5, 3)
    s = layout["w"]
    locals_ = {}
    for r in mesh.all_ranks():
        local = torch.empty(s.local_shape(r))
        for run in s.runs(r):
            local[run.local_slices()] = full[run.global_slices()]
        locals_[r] = local
    plans = {r: [plan_hf_save(s, r)] for r in mesh.all_ranks()}
    programs = {r: unshard(schedule_unshard(plans[r]), plans[r], {"w": locals_[r]}) for r in mesh.all_ranks()}
    replies: dict[int, Any] = dict.fromkeys(mesh.all_ranks())
    outputs = {}
    while programs:
        messages = {}
        for r in list(programs):
            try:
                messages[r] = programs[r].send(replies[r])
            except StopIteration:
                del programs[r]
        for r, m in messages.items():
            if isinstance(m, WaveOutput):
                outputs[r] = m.tensors["w"]
                replies[r] = None
            else:
                group = mesh.group_ranks(r, m.mesh_dim)
                replies[r] = torch.cat([messages[g].send for g in group])
    assert all(torch.equal(outputs[r], full) for r in mesh.all_ranks())
