"""curve points: the dashboard's loss and accuracy curves

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('curve_points',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('cluster', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('loss', sa.Float(), nullable=True),
    sa.Column('test_accuracy', sa.Float(), nullable=True),
    sa.Column('samples_per_s', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('curve_points', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_curve_points_job_id'), ['job_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('curve_points', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_curve_points_job_id'))

    op.drop_table('curve_points')
