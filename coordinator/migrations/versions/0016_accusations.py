"""Accusations: who accused a node of sending values it refused, and whom it accused
(coordinator/failure_rules/accusations.py).

Revision ID: 0016
Revises: 0015
"""
import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # (a database older than the migrations gets its nodes table from today's models: store.upgrade)
    present = {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        for name in ('accusers', 'accused'):
            if name not in present:
                batch_op.add_column(sa.Column(name, sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('accused')
        batch_op.drop_column('accusers')
