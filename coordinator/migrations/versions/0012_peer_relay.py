"""peer_relay_port: where a node's peers that nobody can dial listen for what it sends them (ravnest/relay)

Revision ID: 0012
Revises: 0011
"""
import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its tables from today's models (store.upgrade)
    have = {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}
    if 'peer_relay_port' not in have:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('peer_relay_port', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('peer_relay_port')
