"""Distilled prefill (design §9): a non-recurrent student that predicts the teacher's depth-R endpoint,
its training against a frozen teacher, and student checkpoints tied to that teacher."""

from looplm.distill.checkpoint import load_student, save_student, teacher_hash
from looplm.distill.config import DistillConfig
from looplm.distill.student import EndpointStudent

__all__ = ["DistillConfig", "EndpointStudent", "load_student", "save_student", "teacher_hash"]
