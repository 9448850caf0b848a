"""nodes keep their identity across restarts: the hash of the secret in a node's identity file

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its tables from today's models (store.upgrade)
    if 'identity_hash' not in {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('identity_hash', sa.String(length=64), nullable=True))
            batch_op.create_index('ix_nodes_identity_hash', ['identity_hash'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index('ix_nodes_identity_hash')
        batch_op.drop_column('identity_hash')
