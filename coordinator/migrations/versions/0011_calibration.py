"""calibration: what one message between a node's stages and their neighbours cost (message_s), and a
node's figures per model (by_model), as its jobs measured them (calibration.py)

Revision ID: 0011
Revises: 0010
"""
import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its tables from today's models (store.upgrade)
    have = {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        if 'message_s' not in have:
            batch_op.add_column(sa.Column('message_s', sa.Float(), nullable=True))
        if 'by_model' not in have:
            batch_op.add_column(sa.Column('by_model', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('by_model')
        batch_op.drop_column('message_s')
