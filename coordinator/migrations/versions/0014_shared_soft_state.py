"""What several coordinator processes must share: which job a node trains alone in (its heartbeat
says so to whichever process it reaches) and the unused one-time login links; an index on nodes'
addresses (every join looks up who holds its address: a scan of 10,000 rows without it)

Revision ID: 0014
Revises: 0013
"""
import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    have = {column['name'] for column in sa.inspect(bind).get_columns('nodes')}
    if 'training_alone' not in have:
        with op.batch_alter_table('nodes', schema=None) as batch_op:
            batch_op.add_column(sa.Column('training_alone', sa.String(length=32), nullable=True))
    if 'ix_nodes_address' not in {index['name'] for index in sa.inspect(bind).get_indexes('nodes')}:
        op.create_index('ix_nodes_address', 'nodes', ['address'])
    if 'login_links' not in sa.inspect(bind).get_table_names():
        op.create_table('login_links',
                        sa.Column('code_hash', sa.String(length=64), primary_key=True),
                        sa.Column('sealed_key', sa.Text(), nullable=False),
                        sa.Column('expires_at', sa.Float(), nullable=False, index=True))


def downgrade() -> None:
    op.drop_table('login_links')
    op.drop_index('ix_nodes_address', 'nodes')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('training_alone')
