"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=True),
        sa.Column("stall_seconds", sa.Float(), nullable=True),
        sa.Column("persist_seconds", sa.Float(), nullable=True),
        sa.Column("checksum", sa.String(length=128), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoints_run_generation", ["run_id", "generation"], unique=False)

    op.create_table(
        "events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("domains", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_run_ts", ["run_id", "ts"], unique=False)

    op.create_table(
        "grad_stats",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("group_name", sa.String(length=256), nullable=False),
        sa.Column("owned_sq", sa.Float(), nullable=False),
        sa.Column("local_sq", sa.Float(), nullable=False),
        sa.Column("nonfinite", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("grad_stats", schema=None) as batch_op:
        batch_op.create_index("ix_grad_stats_run_step_group", ["run_id", "step", "group_name"], unique=False)

    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("project", sa.String(length=256), nullable=False),
        sa.Column("registration", sa.JSON(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("run_id"),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_project"), ["project"], unique=False)

    op.create_table(
        "steps",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("step_seconds", sa.Float(), nullable=False),
        sa.Column("compute_seconds", sa.Float(), nullable=True),
        sa.Column("wait_seconds", sa.Float(), nullable=True),
        sa.Column("data_seconds", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("flops", sa.Float(), nullable=True),
        sa.Column("lr", sa.Float(), nullable=True),
        sa.Column("grad_norm", sa.Float(), nullable=True),
        sa.Column("pp_stage", sa.Integer(), nullable=True),
        sa.Column("tp_rank", sa.Integer(), nullable=True),
        sa.Column("dp_rank", sa.Integer(), nullable=True),
        sa.Column("mem_allocated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("mem_reserved_bytes", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.create_index("ix_steps_run_step_rank", ["run_id", "step", "rank"], unique=False)

    op.create_table(
        "tensor_stats",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("tensor", sa.String(length=256), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("format", sa.String(length=8), nullable=False),
        sa.Column("amax", sa.Float(), nullable=False),
        sa.Column("scale", sa.Float(), nullable=True),
        sa.Column("headroom_bits", sa.Float(), nullable=True),
        sa.Column("lag_bits", sa.Float(), nullable=True),
        sa.Column("staleness_steps", sa.Integer(), nullable=True),
        sa.Column("sat_frac", sa.Float(), nullable=True),
        sa.Column("underflow_frac", sa.Float(), nullable=True),
        sa.Column("crest_bits", sa.Float(), nullable=True),
        sa.Column("nonfinite", sa.BigInteger(), nullable=True),
        sa.Column("shadow", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("tensor_stats", schema=None) as batch_op:
        batch_op.create_index("ix_tensor_stats_run_step", ["run_id", "step"], unique=False)
        batch_op.create_index(
            "ix_tensor_stats_run_tensor_step", ["run_id", "tensor", "role", "step"], unique=False
        )

    op.create_table(
        "batches",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "rank", "incarnation", "seq"),
    )


def downgrade() -> None:
    op.drop_table("batches")
    with op.batch_alter_table("tensor_stats", schema=None) as batch_op:
        batch_op.drop_index("ix_tensor_stats_run_tensor_step")
        batch_op.drop_index("ix_tensor_stats_run_step")

    op.drop_table("tensor_stats")
    with op.batch_alter_table("steps", schema=None) as batch_op:
        batch_op.drop_index("ix_steps_run_step_rank")

    op.drop_table("steps")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_project"))

    op.drop_table("runs")
    with op.batch_alter_table("grad_stats", schema=None) as batch_op:
        batch_op.drop_index("ix_grad_stats_run_step_group")

    op.drop_table("grad_stats")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run_ts")

    op.drop_table("events")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_run_generation")

    op.drop_table("checkpoints")
