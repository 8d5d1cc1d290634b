"""WeightSync into pipeline-parallel servers, over real gloo ranks: each server rank's model
holds only its stage's layers (the others set to None, as torch.distributed.pipelining's
manual split makes them; `embed_tokens` on the first stage, `norm` and `lm_head` on the
last), and the sync plans it as `load_into` does: each stage asks for, and receives, only
its layers' slices. After each of two syncs (an optimizer step between), every stage's
tensors equal bit for bit those of `load_into` from a `save_pretrained` checkpoint of the
trainer's weights into the same stage layout."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from checkpoints import build_model, make_config, randomize_, stage_of
from gloo import spawn_cases

LAYERS = 4
STAGES = [({0, 1}, True, False), ({2, 3}, False, True)]  # (layers, first, last) of stages 0 and 1


def _config():
    return make_config("llama", num_hidden_layers=LAYERS)


def _fsdp_trainer(mesh):
    """The trainer: a Llama of LAYERS layers under FSDP2 over `mesh`, its weights drawn apart."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = build_model("llama", _config(), torch.float32, empty=None)
    randomize_(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _stage(pp, form):
    """Stage `pp` of the server, built on meta, its layers in `form` ("none": the others set to
    None in the ModuleList; "dict": a ModuleDict of its layers keyed by their numbers)."""
    return stage_of(build_model("llama", _config(), torch.float32), *STAGES[pp], form)


def _saved(trainer, directory, group) -> None:
    """The trainer's full weights saved by `save_pretrained` into `directory` (rank 0 of the
    job is a trainer rank), seen by every rank of `group` once written."""
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in trainer.state_dict().items()} \
        if trainer is not None else None
    if dist.get_rank() == 0:
        plain = build_model("llama", _config(), torch.float32, empty=None)
        plain.load_state_dict({n: t.detach() for n, t in full.items()})
        plain.save_pretrained(directory)
    dist.barrier(group=group)


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _check_stage(sync, report, server, pp, form, tp_mesh, directory) -> None:
    """The stage equals load_into's of the saved weights into the same stage layout, bit for
    bit, and this rank received (or copied locally) exactly its own share of the stage's
    tensors: its layers' slices, no other stage's."""
    import lazyload

    reference = _stage(pp, form)
    loaded = lazyload.LazyCheckpoint(directory).load_into(reference, mesh=tp_mesh, progress=False)
    assert loaded.other_stages  # the checkpoint holds the other stage's layers
    got, want = server.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(_local(got[name]), _local(tensor)), name
    share = sum(math.prod(_local(t).shape) * t.element_size() for t in want.values())
    assert report.bytes_received + report.bytes_local == share
    asked = {sync.pieces[item.entry.key].name for item in sync.items}
    assert asked == set(want), sorted(asked ^ set(want))
    layers, first, last = STAGES[pp]
    assert {int(n.split(".")[2]) for n in asked if n.startswith("model.layers.")} == layers
    assert ("model.embed_tokens.weight" in asked) == first and ("lm_head.weight" in asked) == last


def _step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.arange(16).reshape(2, 8) % 200
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _two_syncs(trainer, server, pp, form, tp_mesh, tmp):
    """Sync, compare; a trainer step; sync, compare: every rank of the job takes part."""
    import lazyload

    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=tp_mesh if server is not None else None,
                               rank_timeout=60)
    for number in (1, 2):
        if number == 2 and trainer is not None:
            _step(trainer)
        report = sync()
        directory = f"{tmp}/saved{number}"
        _saved(trainer, directory, None)
        if server is not None:
            _check_stage(sync, report, server, pp, form, tp_mesh, directory)
        sent = [None] * dist.get_world_size()
        dist.all_gather_object(sent, (report.bytes_sent, report.bytes_received))
        assert sum(s for s, _ in sent) == sum(r for _, r in sent)  # every byte sent is received once, no more


def _pp2_tp2_colocated(tmp, rank, world):
    """The server PP 2 x TP 2 over the job's 4 ranks; the trainer, FSDP2, on stage 0's two."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh.get_coordinate()[0]
    trainer = _fsdp_trainer(mesh["tp"]) if pp == 0 else None
    _two_syncs(trainer, _stage(pp, "none"), pp, "none", mesh["tp"], tmp)


def _pp2_apart(tmp, rank, world):
    """The trainer, FSDP2, on ranks 0-1; the server PP 2 (TP 1 a stage, its layers a
    ModuleDict) on ranks 2-3."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("role", "x", "tp"))
    role, pp, _ = mesh.get_coordinate()
    trainer = _fsdp_trainer(mesh["x"]) if role == 0 else None
    server = _stage(pp, "dict") if role == 1 else None
    _two_syncs(trainer, server, pp, "dict", mesh["tp"], tmp)


def _run_case(case, rank, world):
    case[0](case[1], rank, world)


def test_sync_into_pipeline_stages(tmp_path):
    spawn_cases(4, [(_pp2_apart, str(tmp_path / "apart")), (_pp2_tp2_colocated, str(tmp_path / "colocated"))],
                tmp_path, _run_case)
