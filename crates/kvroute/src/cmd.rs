//! One module per subcommand.

pub(crate) mod bench;
pub(crate) mod frontend;
pub(crate) mod hash;
pub(crate) mod mocker;
pub(crate) mod router;
pub(crate) mod serve;
