"""The schema as Ravnest created it before it had migrations (create_all).

Revision ID: 0001
Revises: (none)
"""
import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('credentials',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=True),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.Column('uses_left', sa.Integer(), nullable=True),
    sa.Column('used', sa.Integer(), nullable=False),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('token_hash')
    )
    with op.batch_alter_table('credentials', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_credentials_kind'), ['kind'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('owner', sa.String(length=32), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('history', sa.JSON(), nullable=False),
    sa.Column('plan', sa.JSON(), nullable=True),
    sa.Column('final_metrics', sa.JSON(), nullable=True),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('resume', sa.JSON(), nullable=True),
    sa.Column('faults', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_owner'), ['owner'], unique=False)
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)

    op.create_table('links',
    sa.Column('node_id', sa.String(length=32), nullable=False),
    sa.Column('peer_id', sa.String(length=32), nullable=False),
    sa.Column('bandwidth', sa.Float(), nullable=False),
    sa.Column('latency', sa.Float(), nullable=False),
    sa.Column('measured_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('node_id', 'peer_id')
    )
    with op.batch_alter_table('links', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_links_peer_id'), ['peer_id'], unique=False)

    op.create_table('nodes',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('address', sa.String(length=256), nullable=False),
    sa.Column('profile', sa.JSON(), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('token_expires_at', sa.Float(), nullable=True),
    sa.Column('credential_ended', sa.String(length=16), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('joined_at', sa.Float(), nullable=False),
    sa.Column('last_seen', sa.Float(), nullable=False),
    sa.Column('job_id', sa.String(length=32), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_nodes_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_nodes_last_seen'), ['last_seen'], unique=False)
        batch_op.create_index(batch_op.f('ix_nodes_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_nodes_token_hash'), ['token_hash'], unique=False)

    op.create_table('checkpoints',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('file', sa.String(length=256), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('block_start', sa.Integer(), nullable=False),
    sa.Column('block_end', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('job_id', 'file')
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_step'), ['step'], unique=False)

    op.create_table('stages',
    sa.Column('job_id', sa.String(length=32), nullable=False),
    sa.Column('cluster', sa.Integer(), nullable=False),
    sa.Column('stage', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.String(length=32), nullable=False),
    sa.Column('delivered', sa.Boolean(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('weights_uploaded', sa.Boolean(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('job_id', 'cluster', 'stage')
    )
    with op.batch_alter_table('stages', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_stages_node_id'), ['node_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('stages', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_stages_node_id'))

    op.drop_table('stages')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_step'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_token_hash'))
        batch_op.drop_index(batch_op.f('ix_nodes_state'))
        batch_op.drop_index(batch_op.f('ix_nodes_last_seen'))
        batch_op.drop_index(batch_op.f('ix_nodes_job_id'))

    op.drop_table('nodes')
    with op.batch_alter_table('links', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_links_peer_id'))

    op.drop_table('links')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_state'))
        batch_op.drop_index(batch_op.f('ix_jobs_owner'))
        batch_op.drop_index(batch_op.f('ix_jobs_created_at'))

    op.drop_table('jobs')
    with op.batch_alter_table('credentials', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_credentials_kind'))

    op.drop_table('credentials')
