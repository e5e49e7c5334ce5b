"""Launch backends for a worker group: local processes (torchrun) and Kubernetes pods."""
from recforge.elastic.backends.base import Backend, JobFailedError
from recforge.elastic.backends.k8s_manifests import JobPodSettings, PodResources
from recforge.elastic.backends.kubernetes import KubernetesBackend, backend_from_environment
from recforge.elastic.backends.local import LocalBackend, free_port

__all__ = ["Backend", "JobFailedError", "JobPodSettings", "KubernetesBackend", "LocalBackend", "PodResources",
           "backend_from_environment", "free_port"]
