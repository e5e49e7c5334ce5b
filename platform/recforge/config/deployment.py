"""Deployment settings of recforge on Kubernetes, fixed by whoever deploys it (environment), never by a DAG trigger.

`K8sDeployment.from_env()` reads:
  RECFORGE_K8S_NAMESPACE       the namespace every job runs in (default "recforge")
  RECFORGE_K8S_IMAGES          the allow-listed images, comma separated, the default one first
  RECFORGE_K8S_MLFLOW_URI      the in-cluster MLflow (default http://recforge-mlflow:5000)
  RECFORGE_K8S_MLFLOW_SECRET   Secret with keys username / password of the pipeline's MLflow user ("" = none)
  RECFORGE_K8S_JOB_TIMEOUT_S   the Airflow execution_timeout of one training job (default 12 h)
The recforge_train_k8s DAG offers the images as an enum and refuses any other image before a pod exists.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

from pydantic import Field, field_validator

from recforge.config.base import StrictModel

DEFAULT_IMAGE = "registry.example.com/recforge:0.1.0"
# registry/path[:tag][@digest]: no whitespace, no template syntax, no shell metacharacters
_IMAGE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ImageNotAllowed(ValueError):
    """A job asked for an image that is not in the deployment's allow-list."""


class K8sDeployment(StrictModel):
    namespace: str = "recforge"
    images: list[str] = Field(default_factory=lambda: [DEFAULT_IMAGE], min_length=1,
                              description="allow-listed images, the default first")
    mlflow_tracking_uri: str = "http://recforge-mlflow:5000"
    mlflow_secret: str | None = "recforge-mlflow-pipeline"
    job_timeout_s: float = Field(12 * 3600.0, gt=0)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not _DNS_LABEL.match(v):
            raise ValueError(f"namespace {v!r} is not a DNS-1123 label")
        return v

    @field_validator("images")
    @classmethod
    def _images(cls, v: list[str]) -> list[str]:
        bad = [i for i in v if not _IMAGE.match(i)]
        if bad:
            raise ValueError(f"not image references: {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"images listed twice: {sorted({i for i in v if v.count(i) > 1})}")
        return v

    @property
    def default_image(self) -> str:
        return self.images[0]

    def check_image(self, image: object) -> str:
        """`image` if it is allow-listed, else ImageNotAllowed naming it and the allow-list."""
        if not isinstance(image, str) or image not in self.images:
            raise ImageNotAllowed(f"image {image!r} is not allow-listed for recforge jobs (RECFORGE_K8S_IMAGES: "
                                  f"{', '.join(self.images)})")
        return image

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> K8sDeployment:
        env = os.environ if env is None else env
        kw: dict[str, object] = {}
        if env.get("RECFORGE_K8S_NAMESPACE"):
            kw["namespace"] = env["RECFORGE_K8S_NAMESPACE"]
        if env.get("RECFORGE_K8S_IMAGES"):
            kw["images"] = [i.strip() for i in env["RECFORGE_K8S_IMAGES"].split(",") if i.strip()]
        if env.get("RECFORGE_K8S_MLFLOW_URI"):
            kw["mlflow_tracking_uri"] = env["RECFORGE_K8S_MLFLOW_URI"]
        if "RECFORGE_K8S_MLFLOW_SECRET" in env:
            kw["mlflow_secret"] = env["RECFORGE_K8S_MLFLOW_SECRET"] or None
        if env.get("RECFORGE_K8S_JOB_TIMEOUT_S"):
            kw["job_timeout_s"] = env["RECFORGE_K8S_JOB_TIMEOUT_S"]
        return cls.model_validate(kw)
