"""tls_name: the host a node joined at, which its certificate names once it is reached through a relay

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its tables from today's models (store.upgrade)
    if 'tls_name' not in {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('tls_name', sa.String(length=255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('tls_name')
