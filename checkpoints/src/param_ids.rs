//! Parameter ids by module path. burn keys optimizer state by parameter id, and safetensors (the
//! weights' format, see `k3mini_student::hf::save_hf_files`) has no place for ids, so a checkpoint
//! carries this path → id map and resuming gives the fresh model its old ids back.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use std::collections::BTreeMap;

/// The current module path, with enum variant names left out (as in the safetensors names).
#[derive(Default)]
struct PathStack(Vec<Option<String>>);

impl PathStack {
    fn enter(&mut self, name: &str, container_type: &str) {
        self.0
            .push((!container_type.starts_with("Enum:")).then(|| name.to_string()));
    }

    fn exit(&mut self) {
        self.0.pop();
    }

    fn path(&self) -> String {
        self.0
            .iter()
            .flatten()
            .cloned()
            .collect::<Vec<_>>()
            .join(".")
    }
}

/// A float parameter as a checkpoint names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamEntry {
    /// Module path, enum variants left out (`model.layers.0.mlp.down_proj.weight`).
    pub path: String,
    pub id: u64,
    pub shape: Vec<usize>,
}

/// Every float parameter, in the module's order.
pub fn param_entries<M: Module>(module: &M) -> Vec<ParamEntry> {
    #[derive(Default)]
    struct Entries {
        path: PathStack,
        out: Vec<ParamEntry>,
    }
    impl ModuleVisitor for Entries {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.enter(name, container_type);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.out.push(ParamEntry {
                path: self.path.path(),
                id: param.id.val(),
                shape: param.dims().to_vec(),
            });
        }
    }
    let mut v = Entries::default();
    module.visit(&mut v);
    v.out
}

/// Module path → parameter id, for every float parameter.
pub fn param_ids<M: Module>(module: &M) -> BTreeMap<String, u64> {
    param_entries(module)
        .into_iter()
        .map(|p| (p.path, p.id))
        .collect()
}

/// Gives every float parameter the id recorded for its path. Errors if a path is missing.
pub fn restore_param_ids<M: Module>(
    module: M,
    ids: &BTreeMap<String, u64>,
) -> Result<M, crate::CheckpointError> {
    struct Restore<'a> {
        path: PathStack,
        ids: &'a BTreeMap<String, u64>,
        missing: Vec<String>,
    }
    impl ModuleMapper for Restore<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.enter(name, container_type);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let path = self.path.path();
            match self.ids.get(&path) {
                Some(&id) => {
                    let value = param.val();
                    param.transform_for_load(value, ParamId::from(id))
                }
                None => {
                    self.missing.push(path);
                    param
                }
            }
        }
    }
    let mut mapper = Restore {
        path: PathStack::default(),
        ids,
        missing: Vec::new(),
    };
    let module = module.map(&mut mapper);
    if mapper.missing.is_empty() {
        Ok(module)
    } else {
        Err(crate::CheckpointError::MissingIds(mapper.missing))
    }
}
