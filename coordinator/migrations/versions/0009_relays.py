"""relays: the port a node relays on for others, and the relay a node is reached through (service/reachability.py)

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its tables from today's models (store.upgrade)
    if 'relay_port' not in {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('relay_port', sa.Integer(), nullable=True))
            batch_op.add_column(sa.Column('relayed_by', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('relayed_by')
        batch_op.drop_column('relay_port')
