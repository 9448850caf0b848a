"""curve points keep the held-out loss: a language model's perplexity curve on the dashboard

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its tables from today's models (store.upgrade)
    if 'test_loss' not in {column['name'] for column in sa.inspect(op.get_bind()).get_columns('curve_points')}:
        with op.batch_alter_table('curve_points', schema=None) as batch_op:
            batch_op.add_column(sa.Column('test_loss', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('curve_points', schema=None) as batch_op:
        batch_op.drop_column('test_loss')
