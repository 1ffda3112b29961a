"""``shardline fleet render -f fleet.yaml --out DIR``: a fleet spec as Kubernetes objects.

Writes ``DIR/shardline.yaml`` (the router, planner, loader, telemetry and fleet controller:
Deployments, Services, the controller's ConfigMap, ServiceAccount, Role and RoleBinding) and one
``DIR/<group>.yaml`` LeaderWorkerSet per desired replica group, named as the controller names
them. Nothing is applied: ``kubectl apply -n NS -f DIR`` does that, into a namespace that exists
on a cluster with the LeaderWorkerSet controller installed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.fleet.kubernetes import KubernetesRenderError, KubernetesSettings, Resources, group_name, render_group
from services.fleet.kubernetes_provisioner import YamlDirectory
from services.fleet.kubernetes_services import render_services
from services.fleet.provisioner import GroupLaunch
from services.fleet.spec import FleetSpec, InvalidFleetSpec

SERVICES_FILE = "shardline"  # DIR/shardline.yaml


def add_render_command(subparsers: argparse._SubParsersAction, *, name: str = "render") -> None:
    """Adds the command as ``name`` (``shardline fleet render``; this module is no command of its own)."""
    defaults = KubernetesSettings()
    parser = subparsers.add_parser(name, help="write a fleet spec's Kubernetes objects (LeaderWorkerSets, "
                                              "Deployments, Services) to a directory",
                                   description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("-f", "--file", type=Path, required=True, help="the fleet spec (shard-plan.yaml shape)")
    parser.add_argument("--out", type=Path, required=True, help="directory the YAML files go to")
    parser.add_argument("--revision", type=int, default=1, help="the spec's revision, for labels and group names "
                                                                "(default 1)")
    parser.add_argument("--image", default=defaults.image, help=f"container image (default {defaults.image})")
    parser.add_argument("--namespace", default=defaults.namespace, help=f"default {defaults.namespace}")
    parser.add_argument("--registry-url", default=defaults.registry_url,
                        help=f"shard registry URL every pod gets; '' for none (default {defaults.registry_url})")
    parser.add_argument("--redis-url", default=defaults.redis_url,
                        help=f"health store URL; '' for none (default {defaults.redis_url})")
    parser.add_argument("--secret", default=defaults.secret_name,
                        help=f"Secret every pod takes env from (SHARDLINE_INTERNAL_TOKEN, PGPASSWORD); '' for none "
                             f"(default {defaults.secret_name})")
    rank = defaults.rank_resources
    parser.add_argument("--rank-cpu", default=rank.cpu, help=f"CPU per rank (default {rank.cpu})")
    parser.add_argument("--rank-memory", default=rank.memory, help=f"memory per rank (default {rank.memory})")
    parser.add_argument("--gpus-per-rank", type=int, default=rank.gpus,
                        help=f"nvidia.com/gpu per rank, 0 for CPU ranks (default {rank.gpus})")
    parser.add_argument("--model-claim", default=None,
                        help="PersistentVolumeClaim with the model directories, mounted read-only at --model-mount")
    parser.add_argument("--model-mount", default=defaults.model_mount, help=f"default {defaults.model_mount}")
    parser.add_argument("--router-model-dir", default=None,
                        help="the router's tokenizer directory as its pod sees it (default: the plan's model_dir)")
    parser.set_defaults(func=_run)


def settings_from(args: argparse.Namespace) -> KubernetesSettings:
    return KubernetesSettings(
        image=args.image, namespace=args.namespace, registry_url=args.registry_url or None,
        redis_url=args.redis_url or None, secret_name=args.secret or None,
        rank_resources=Resources(cpu=args.rank_cpu, memory=args.rank_memory, gpus=args.gpus_per_rank),
        model_claim=args.model_claim, model_mount=args.model_mount, router_model_dir=args.router_model_dir)


def render_fleet(spec: FleetSpec, settings: KubernetesSettings, revision: int) -> dict[str, list[dict]]:
    """File stem -> its objects: the shared services, then each desired group's LeaderWorkerSet."""
    files = {SERVICES_FILE: render_services(spec, settings)}
    for index in range(spec.replicas):
        launch = GroupLaunch(group_name(spec.name, revision, index), spec.name, revision, spec.group,
                             spec.served_model_name)
        files[launch.name] = [render_group(launch, settings)]
    return files


def _run(args: argparse.Namespace) -> int:
    try:
        spec = FleetSpec.load(args.file)
        files = render_fleet(spec, settings_from(args), args.revision)
    except (InvalidFleetSpec, KubernetesRenderError) as exc:
        print(f"shardline fleet render: {exc}", flush=True)
        return 2
    out = YamlDirectory(args.out)
    for stem, objects in files.items():
        out.apply(stem, objects)
        print(out.path(stem))
    return 0
