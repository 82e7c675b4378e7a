"""Student checkpoints, tied to their teacher by a content hash of the teacher's weights (design §9).

A student checkpoint is a looplm checkpoint folder (atomic write, SHA-256 manifest; see
`looplm.checkpoint`) holding
  student.safetensors    the student's weights
  student.json           its shape, the teacher's content hash and path, the distillation config
  optimizer.safetensors  optimizer tensors, distill_state.json (step, the energy E, ...): training only
A student loads only against the teacher it was distilled from.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from looplm import checkpoint as ckpt
from looplm.distill.student import EndpointStudent

STUDENT_FILE = "student.json"


def teacher_hash(model: torch.nn.Module) -> str:
    """SHA-256 of a model's weights: every state-dict entry's name, dtype, shape and bytes, in name order.
    Independent of the file a checkpoint was stored in, and of the device the model is on."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_student(tmp: Path, student: EndpointStudent, meta: dict) -> None:
    """Write the student's weights and `student.json` (its arch plus `meta`) into a checkpoint folder
    being populated by `looplm.checkpoint.write_atomic`."""
    if "teacher_sha256" not in meta:
        raise ValueError("a student checkpoint must record its teacher's content hash")
    ckpt.save_tensors(tmp, "student.safetensors", student.state_dict())
    ckpt.write_json(tmp, STUDENT_FILE, {**meta, "arch": student.arch()})


def save_student(path: Path, student: EndpointStudent, teacher: torch.nn.Module, **meta) -> Path:
    """A weights-only student checkpoint at `path` for `teacher` (`meta` goes into student.json)."""
    sha = teacher_hash(teacher)
    return ckpt.write_atomic(Path(path), lambda tmp: write_student(tmp, student, {**meta, "teacher_sha256": sha}))


def load_student(path: Path, teacher: torch.nn.Module) -> tuple[EndpointStudent, dict]:
    """(student in eval mode on the teacher's device, its student.json) from a verified checkpoint or
    run folder. Raises CheckpointError when it was distilled from another teacher."""
    path = ckpt.resolve(Path(path))
    ckpt.verify(path)
    try:
        meta = ckpt.read_json(path, STUDENT_FILE)
    except FileNotFoundError:
        raise ckpt.CheckpointError(f"{path} is not a student checkpoint (no {STUDENT_FILE})") from None
    want, have = meta.get("teacher_sha256"), teacher_hash(teacher)
    if want != have:
        raise ckpt.CheckpointError(
            f"{path}: this student was distilled from another teacher (weights hash "
            f"{str(want)[:12]}, the given teacher's is {have[:12]})"
        )
    try:
        student = EndpointStudent.from_arch(meta["arch"])
    except (KeyError, TypeError, ValueError) as err:
        raise ckpt.CheckpointError(f"{path}: unreadable student shape ({err})") from None
    weights = ckpt.load_tensors(path, "student.safetensors")
    ckpt.check_model_shapes(student.state_dict(), weights, path)
    student.load_state_dict(weights)
    return student.to(next(teacher.parameters()).device).eval(), meta
