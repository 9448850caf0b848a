"""beat_interval_s: the heartbeat interval a node was last told (it grows with the number of nodes)

Revision ID: 0013
Revises: 0012
"""
import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    have = {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}
    if 'beat_interval_s' not in have:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('beat_interval_s', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('beat_interval_s')
