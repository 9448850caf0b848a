"""volunteers' claims: offers and their proofs, the re-plans a node's reports caused, quarantine

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a database from before the migrations gets its nodes table from today's models (store.upgrade),
    # columns included: add only what is missing
    present = {column['name'] for column in sa.inspect(op.get_bind()).get_columns('nodes')}
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        for column in (sa.Column('replans_caused', sa.JSON(), nullable=True),
                       sa.Column('quarantined_until', sa.Float(), nullable=True),
                       sa.Column('quarantine_reason', sa.Text(), nullable=True)):
            if column.name not in present:
                batch_op.add_column(column)
    op.create_table('offers',
    sa.Column('node_id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('fingerprint', sa.String(length=96), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('challenge', sa.JSON(), nullable=True),
    sa.Column('offered_at', sa.Float(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('node_id', 'name')
    )
    with op.batch_alter_table('offers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_offers_fingerprint'), ['fingerprint'], unique=False)
    op.create_table('challenges',
    sa.Column('nonce', sa.String(length=32), nullable=False),
    sa.Column('fingerprint', sa.String(length=96), nullable=False),
    sa.Column('ranges', sa.JSON(), nullable=False),
    sa.Column('answer', sa.String(length=64), nullable=False),
    sa.PrimaryKeyConstraint('nonce')
    )
    with op.batch_alter_table('challenges', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_challenges_fingerprint'), ['fingerprint'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('challenges', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_challenges_fingerprint'))
    op.drop_table('challenges')
    with op.batch_alter_table('offers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_offers_fingerprint'))
    op.drop_table('offers')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('quarantine_reason')
        batch_op.drop_column('quarantined_until')
        batch_op.drop_column('replans_caused')
