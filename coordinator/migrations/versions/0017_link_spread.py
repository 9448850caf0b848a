"""How far a link's repeated probes lay apart, and how many rounds measured it: a wide link is
measured again (service/link_probes.py).

Revision ID: 0017
Revises: 0016
"""
import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    present = {column['name'] for column in sa.inspect(op.get_bind()).get_columns('links')}
    with op.batch_alter_table('links', schema=None) as batch_op:
        if 'spread' not in present:
            batch_op.add_column(sa.Column('spread', sa.Float(), nullable=False, server_default='1.0'))
        if 'rounds' not in present:
            batch_op.add_column(sa.Column('rounds', sa.Integer(), nullable=False, server_default='1'))


def downgrade() -> None:
    with op.batch_alter_table('links', schema=None) as batch_op:
        batch_op.drop_column('rounds')
        batch_op.drop_column('spread')
