//! Multimodal block information as Python hands it over.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use kvroute_core::{BlockExtraInfo, BlockMmObjectInfo};

/// Reads `block_mm_infos`: a list with one entry per block, `None` or
/// `{"mm_objects": [{"mm_hash": int, "offsets": [[start, end], ...]}, ...]}`.
pub(crate) fn mm_infos(
    value: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<Option<BlockExtraInfo>>>> {
    let Some(value) = value.filter(|v| !v.is_none()) else { return Ok(None) };
    let list = value.cast::<PyList>().map_err(|_| {
        PyTypeError::new_err("block_mm_infos must be a list (one entry per block) or None")
    })?;
    let mut out = Vec::with_capacity(list.len());
    for (i, block) in list.iter().enumerate() {
        if block.is_none() {
            out.push(None);
            continue;
        }
        let dict = block.cast::<PyDict>().map_err(|_| {
            PyTypeError::new_err(format!(
                "block_mm_infos[{i}] must be None or a dict with \"mm_objects\""
            ))
        })?;
        let objects = dict.get_item("mm_objects")?.ok_or_else(|| {
            PyValueError::new_err(format!("block_mm_infos[{i}] has no \"mm_objects\""))
        })?;
        let objects = objects.cast::<PyList>().map_err(|_| {
            PyTypeError::new_err(format!("block_mm_infos[{i}][\"mm_objects\"] must be a list"))
        })?;
        let mut mm_objects = Vec::with_capacity(objects.len());
        for (j, object) in objects.iter().enumerate() {
            let where_ = format!("block_mm_infos[{i}][\"mm_objects\"][{j}]");
            let object = object
                .cast::<PyDict>()
                .map_err(|_| PyTypeError::new_err(format!("{where_} must be a dict")))?;
            let mm_hash = object
                .get_item("mm_hash")?
                .ok_or_else(|| PyValueError::new_err(format!("{where_} has no \"mm_hash\"")))?
                .extract::<u64>()
                .map_err(|_| {
                    PyValueError::new_err(format!(
                        "{where_}[\"mm_hash\"] must be an int in 0..2**64"
                    ))
                })?;
            let offsets = match object.get_item("offsets")? {
                None => Vec::new(),
                Some(o) if o.is_none() => Vec::new(),
                Some(o) => o
                    .extract::<Vec<Vec<usize>>>()
                    .ok()
                    .and_then(|pairs| {
                        pairs
                            .iter()
                            .map(|p| match p.as_slice() {
                                &[start, end] => Some((start, end)),
                                _ => None,
                            })
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| {
                        PyValueError::new_err(format!(
                            "{where_}[\"offsets\"] must be a list of [start, end] pairs"
                        ))
                    })?,
            };
            mm_objects.push(BlockMmObjectInfo { mm_hash, offsets });
        }
        out.push(Some(BlockExtraInfo { mm_objects }));
    }
    Ok(Some(out))
}
