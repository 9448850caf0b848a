"""measured compute: a node's FLOP/s as its stages measured them, where its profile claimed far more

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its nodes table from today's models (store.upgrade)
    if 'measured_flops' not in {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('measured_flops', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('measured_flops')
