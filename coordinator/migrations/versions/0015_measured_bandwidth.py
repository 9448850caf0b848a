"""A node's bandwidth as its peers measured it, where that was far below its own claim (calibration.py:
the planner's figure since)

Revision ID: 0015
Revises: 0014
"""
import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if 'measured_bandwidth' not in {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('measured_bandwidth', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('measured_bandwidth')
