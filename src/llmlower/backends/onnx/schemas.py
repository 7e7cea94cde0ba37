"""ONNX Runtime's contrib ops as onnx OpSchemas, so that onnxscript (and torch.onnx's exporter) can build
nodes for them. The schemas are read from the onnxruntime installed here, never written by hand."""

from __future__ import annotations

import functools

import onnx
from onnxruntime.capi import onnxruntime_pybind11_state as ort_capi

_OPTION = {
    "Single": onnx.defs.OpSchema.FormalParameterOption.Single,
    "Optional": onnx.defs.OpSchema.FormalParameterOption.Optional,
    "Variadic": onnx.defs.OpSchema.FormalParameterOption.Variadic,
}


@functools.cache
def _ort_schemas() -> dict[tuple[str, str], object]:
    schemas = {}
    for schema in ort_capi.get_all_operator_schema():
        key = (schema.domain, schema.name)
        if key not in schemas or schema.since_version > schemas[key].since_version:
            schemas[key] = schema
    return schemas


def _parameter(p) -> onnx.defs.OpSchema.FormalParameter:
    return onnx.defs.OpSchema.FormalParameter(p.name, p.typeStr, p.description, param_option=_OPTION[p.option.name])


def ensure_schema(domain: str, name: str, outputs: int | None = None) -> int:
    """Register ONNX Runtime's schema of op `name` in `domain` with onnx (once); returns its version.
    `outputs` keeps only the first outputs: torch.onnx's exporter gives a node every output its schema
    lists, and some optional outputs change what an op does (GroupQueryAttention's output_qk)."""
    if onnx.defs.has(name, domain):
        return onnx.defs.get_schema(name, domain=domain).since_version
    ort = _ort_schemas().get((domain, name))
    if ort is None:
        raise KeyError(f"onnxruntime has no op {domain or 'ai.onnx'}::{name}")
    schema = onnx.defs.OpSchema(
        name,
        domain,
        ort.since_version,
        ort.doc or "",
        inputs=[_parameter(p) for p in ort.inputs],
        outputs=[_parameter(p) for p in ort.outputs[:outputs]],
        type_constraints=[(t.type_param_str, t.allowed_type_strs, t.description) for t in ort.type_constraints],
        attributes=[
            onnx.defs.OpSchema.Attribute(
                a.name, onnx.defs.OpSchema.AttrType(int(a.type)), a.description, required=a.required
            )
            for a in ort.attributes.values()
        ],
    )
    onnx.defs.register_schema(schema)
    return ort.since_version
