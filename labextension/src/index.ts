/**
 * monarch-kernel's JupyterLab extension: a "Meshes" panel in the left sidebar.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';

import { MeshesPanel } from './panel';
import { TARGET } from './protocol';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" width="16" viewBox="0 0 24 24">' +
  '<g class="jp-icon3" fill="#616161">' +
  '<circle cx="5" cy="5" r="2.5"/><circle cx="12" cy="5" r="2.5"/><circle cx="19" cy="5" r="2.5"/>' +
  '<circle cx="5" cy="12" r="2.5"/><circle cx="12" cy="12" r="2.5"/><circle cx="19" cy="12" r="2.5"/>' +
  '<circle cx="5" cy="19" r="2.5"/><circle cx="12" cy="19" r="2.5"/><circle cx="19" cy="19" r="2.5"/>' +
  '</g></svg>';

export const meshesIcon = new LabIcon({ name: 'monarch-kernel:meshes', svgstr: ICON_SVG });

/** Listen, on every notebook's kernel, for monarch_kernel announcing that it just loaded. */
function watchAnnouncements(notebook: NotebookPanel, panel: MeshesPanel): void {
  const onAnnounce = (comm: Kernel.IComm) => {
    comm.close(); // the announcement carries nothing more; the panel opens its own comm
    panel.announced(notebook);
  };
  const attach = (kernel: Kernel.IKernelConnection | null | undefined) => {
    kernel?.registerCommTarget(TARGET, onAnnounce);
  };
  attach(notebook.sessionContext.session?.kernel);
  notebook.sessionContext.kernelChanged.connect((_, change) => {
    change.oldValue?.removeCommTarget(TARGET, onAnnounce);
    attach(change.newValue);
  });
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-meshes:plugin',
  description: 'The meshes of the notebook\u2019s kernel, live, in the left sidebar.',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker) => {
    const panel = new MeshesPanel(notebook => app.shell.activateById(notebook.id));
    panel.title.icon = meshesIcon;
    panel.title.caption = 'Meshes';
    app.shell.add(panel, 'left', { rank: 650 });

    tracker.widgetAdded.connect((_, notebook) => watchAnnouncements(notebook, panel));
    tracker.forEach(notebook => watchAnnouncements(notebook, panel));
    // follow the notebook in focus; keep showing the last one while another kind of tab is
    // active (a file browser or a terminal), as the table of contents does
    tracker.currentChanged.connect((_, notebook) => panel.follow(notebook));
    panel.follow(tracker.currentWidget);
  }
};

export default plugin;
