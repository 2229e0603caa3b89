//! What one workload's runs left: the workload, its rate, each run's data and summary.

use crate::run::RunData;
use crate::summary::Summary;
use crate::workload::Workload;

/// Every run of one workload at one rate.
#[derive(Debug)]
pub struct WorkloadResult {
    pub workload: Workload,
    pub rate: Option<f64>,
    /// Which of the `--runs` at this rate (0 first).
    pub run: usize,
    pub runs: Vec<(RunData, Summary)>,
}
