/**
 * The Meshes sidebar: for the notebook in focus, every mesh its kernel holds, live, with
 * actions (interrupt, restart, down, a rank's logs, insert a `%%mesh` cell).
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { LinkState, MeshLink } from './connection';
import { IContainer, IPart, patchChildren } from './patch';
import { IMesh, IRank, IResultMessage } from './protocol';

const LOG_LINES = 40;

const STATE_TEXT: Record<Exclude<LinkState, 'ready'>, string> = {
  'no-kernel': 'This notebook has no running kernel.',
  connecting: 'Connecting to the kernel\u2026',
  'not-loaded': ''
};

function esc(text: unknown): string {
  return String(text ?? '')
    .replace(/&/g, '&amp;')
    .replace(/</g, '&lt;')
    .replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;');
}

function shapeText(shape: Record<string, number>): string {
  return Object.entries(shape)
    .map(([dim, size]) => `${dim} ${size}`)
    .join(' \u00d7 ');
}

function bytesText(n: number | null): string {
  if (n === null || n === undefined) {
    return '';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function stateCounts(ranks: IRank[]): string {
  const counts = new Map<string, number>();
  for (const r of ranks) {
    counts.set(r.state, (counts.get(r.state) ?? 0) + 1);
  }
  return [...counts.entries()].map(([state, n]) => `${n} ${state}`).join(' \u00b7 ');
}

interface IShownLogs {
  mesh: string;
  rank: number;
  lines: [string, string][];
}

export class MeshesPanel extends Widget {
  constructor(private readonly _focus: (notebook: NotebookPanel) => void) {
    super();
    this.id = 'monarch-kernel-meshes';
    this.addClass('mk-panel');
    this.node.innerHTML =
      '<div class="mk-header"><span class="mk-title">Meshes</span>' +
      '<span class="mk-context"></span>' +
      '<button class="mk-button" data-action="refresh" title="Ask the kernel again">Refresh</button></div>' +
      '<div class="mk-body"></div><div class="mk-status" role="status"></div>';
    this.node.addEventListener('click', event => this._onClick(event));
    this._render();
  }

  /** The link the panel shows (null when no notebook is in focus). */
  get link(): MeshLink | null {
    return this._link;
  }

  /** Show the meshes of this notebook's kernel (null: no notebook in focus). */
  follow(notebook: NotebookPanel | null): void {
    if (notebook === this._notebook && this._link) {
      return;
    }
    this._link?.dispose();
    this._link = null;
    this._notebook = notebook;
    this._logs = null;
    this._setStatus('');
    if (notebook && !notebook.isDisposed) {
      const link = new MeshLink(notebook.sessionContext);
      link.changed.connect(() => this._render(), this);
      link.results.connect((_, result) => this._onResult(result), this);
      this._link = link;
      notebook.disposed.connect(() => {
        if (this._notebook === notebook) {
          this.follow(null);
        }
      });
    }
    this._render();
  }

  /** Called when a kernel announces that monarch_kernel loaded in it. */
  announced(notebook: NotebookPanel): void {
    if (notebook === this._notebook) {
      this._link?.announced();
    }
  }

  dispose(): void {
    this._link?.dispose();
    super.dispose();
  }

  private get _body(): HTMLElement {
    return this.node.querySelector('.mk-body') as HTMLElement;
  }

  private _setStatus(message: string, ok = true): void {
    const status = this.node.querySelector('.mk-status') as HTMLElement;
    status.textContent = message;
    status.classList.toggle('mk-error', !ok);
  }

  private _render(): void {
    const context = this.node.querySelector('.mk-context') as HTMLElement;
    context.textContent = this._notebook ? this._notebook.title.label : '';
    const link = this._link;
    const body = this._body;
    body.dataset.state = link ? link.state : 'no-notebook';
    if (!link) {
      body.innerHTML = '<p class="mk-note">Open a notebook to see the meshes of its kernel.</p>';
      return;
    }
    if (link.state === 'not-loaded') {
      body.innerHTML =
        '<p class="mk-note">monarch_kernel is not loaded in this notebook\'s kernel. Run ' +
        '<code>%load_ext monarch_kernel</code> in a cell (or pick the kernel ' +
        '<b>Python 3 (monarch)</b>), then start a mesh with <code>%mesh up local --gpus 2</code>.</p>' +
        '<button class="mk-button" data-action="refresh">Check again</button>';
      return;
    }
    if (link.state !== 'ready') {
      body.innerHTML = `<p class="mk-note">${esc(STATE_TEXT[link.state])}</p>`;
      return;
    }
    if (!link.meshes.length) {
      body.innerHTML =
        '<p class="mk-note">No mesh in this kernel yet. Start one with ' +
        '<code>%mesh up local --gpus 2</code>.</p>';
      return;
    }
    patchChildren(body, link.meshes.map(mesh => this._meshParts(mesh, link.colours, link.glyphs)));
  }

  private _meshParts(mesh: IMesh, colours: Record<string, string>, glyphs: Record<string, string>): IContainer {
    const name = esc(mesh.name);
    const open = !this._collapsed.has(mesh.name);
    const meta = [mesh.kind, shapeText(mesh.shape), mesh.dist === 'none' ? 'no dist' : mesh.dist]
      .map(esc)
      .join(' \u00b7 ');
    const up = mesh.state === 'up';
    const button = (action: string, label: string, title: string) =>
      `<button class="mk-button" data-action="${action}" data-mesh="${name}" title="${esc(title)}"` +
      `${up ? '' : ' disabled'}>${label}</button>`;
    const parts: (IPart | IContainer)[] = [
      {
        key: 'head',
        html:
          `<div class="mk-mesh-head"><button class="mk-toggle" data-action="toggle" data-mesh="${name}" ` +
          `aria-expanded="${open}" title="Show or hide the ranks">${open ? '\u25be' : '\u25b8'}</button>` +
          `<span class="mk-name">${name}</span>${mesh.default ? '<span class="mk-badge">default</span>' : ''}` +
          `<span class="mk-mesh-state">${esc(mesh.state)}</span></div>`
      },
      {
        key: 'meta',
        html: `<div class="mk-meta">${meta} \u00b7 <span class="mk-counts">${esc(stateCounts(mesh.ranks))}</span></div>`
      }
    ];
    if (mesh.allocation) {
      const short = mesh.allocation.includes('less than 10 minutes left');
      parts.push({
        key: 'allocation',
        html: `<div class="mk-allocation${short ? ' mk-warn' : ''}" title="the Slurm job">${esc(mesh.allocation)}</div>`
      });
    }
    if (mesh.hosts.length) {
      parts.push({ key: 'hosts', html: `<div class="mk-hosts" title="hosts">${mesh.hosts.map(esc).join(', ')}</div>` });
    }
    parts.push({
      key: 'actions',
      html:
        '<div class="mk-actions">' +
        button('interrupt', 'Interrupt', 'Interrupt what runs on every rank') +
        button('restart', 'Restart', 'A fresh mesh of the same shape (namespaces are lost)') +
        button('down', 'Down', 'Stop every rank of this mesh') +
        button('insert', 'Insert cell', `Insert a %%mesh --name ${mesh.name} cell below the active one`) +
        '</div>'
    });
    if (open && mesh.ranks.length) {
      parts.push({
        key: 'grid',
        tag: 'div',
        attributes: { class: 'mk-grid' },
        parts: mesh.ranks.map(r => ({ key: String(r.rank), html: this._rankHtml(mesh, r, colours, glyphs) }))
      });
    }
    const logs = this._logs;
    if (logs && logs.mesh === mesh.name) {
      const lines = logs.lines.length
        ? logs.lines.map(([stream, line]) => `<span class="mk-${esc(stream)}">${esc(line)}</span>`).join('\n')
        : '(nothing printed yet)';
      parts.push({
        key: 'logs',
        html:
          `<div class="mk-logs" data-rank="${logs.rank}"><div class="mk-logs-head">rank ${logs.rank}: last lines ` +
          '<button class="mk-button" data-action="close-logs">Close</button></div>' +
          `<pre>${lines}</pre></div>`
      });
    }
    return {
      key: `mesh:${mesh.name}`,
      tag: 'section',
      attributes: { class: 'mk-mesh', 'data-mesh': mesh.name, 'data-state': mesh.state },
      parts
    };
  }

  private _rankHtml(mesh: IMesh, r: IRank, colours: Record<string, string>, glyphs: Record<string, string>): string {
    const where = Object.entries(r.coords)
      .map(([dim, i]) => `${dim}=${i}`)
      .join(' ');
    const load = [r.cpu === null || r.cpu === undefined ? '' : `cpu ${r.cpu.toFixed(0)}%`, bytesText(r.rss)]
      .filter(Boolean)
      .join(' \u00b7 ');
    const title = `rank ${r.rank} (${where}) on ${r.host}, pid ${r.pid ?? '-'}: ${r.state}` +
      `${r.detail ? ` \u2014 ${r.detail}` : ''}\nClick for its recent output.`;
    const colour = colours[r.state];
    // the state as a badge: glyph and word in white on the state's colour (readable in any theme,
    // and not told by colour alone), as in the notebook's mesh view
    return (
      `<div class="mk-rank mk-state-${esc(r.state)}" data-action="logs" data-mesh="${esc(mesh.name)}" ` +
      `data-rank="${r.rank}" data-state="${esc(r.state)}" title="${esc(title)}"` +
      `${colour ? ` style="border-left-color:${esc(colour)}"` : ''}>` +
      `<span class="mk-rank-id">${r.rank}</span> <span class="mk-rank-state"` +
      `${colour ? ` style="background:${esc(colour)}"` : ''}>${esc(glyphs[r.state] ?? '?')} ${esc(r.state)}</span>` +
      `<div class="mk-rank-detail">${esc(r.detail)}</div><div class="mk-rank-load">${esc(load)}</div></div>`
    );
  }

  private _onClick(event: MouseEvent): void {
    const target = (event.target as HTMLElement).closest('[data-action]') as HTMLElement | null;
    if (!target || (target as HTMLButtonElement).disabled) {
      return;
    }
    const action = target.dataset.action;
    const mesh = target.dataset.mesh ?? '';
    switch (action) {
      case 'refresh':
        this._link?.refresh();
        break;
      case 'toggle':
        if (!this._collapsed.delete(mesh)) {
          this._collapsed.add(mesh);
        }
        this._render();
        break;
      case 'close-logs':
        this._logs = null;
        this._render();
        break;
      case 'interrupt':
        this._interrupt(mesh);
        break;
      case 'restart':
        this._ask('restart', mesh, `Restarting mesh ${mesh}\u2026`);
        break;
      case 'down':
        void this._down(mesh);
        break;
      case 'logs':
        this._ask('logs', mesh, `Asking rank ${target.dataset.rank} for its output\u2026`, {
          rank: Number(target.dataset.rank),
          lines: LOG_LINES
        });
        break;
      case 'insert':
        this._insertCell(mesh);
        break;
    }
  }

  /** Send an action; say so when the kernel is busy and cannot hear it before the cell ends. */
  private _ask(action: 'interrupt' | 'restart' | 'down' | 'logs', mesh: string, pending: string,
               extra: Record<string, number> = {}): void {
    const link = this._link;
    if (!link || !link.act(action, mesh, extra)) {
      this._setStatus('No link to the kernel: press Refresh.', false);
      return;
    }
    const kernel = link.kernel;
    const queued = kernel && kernel.status === 'busy' && !kernel.supportsSubshells;
    this._setStatus(queued ? `${pending} (the kernel is busy: it acts when the running cell ends)` : pending);
  }

  private _interrupt(mesh: string): void {
    const kernel = this._link?.kernel;
    if (kernel && kernel.status === 'busy' && !kernel.supportsSubshells) {
      // A kernel without subshells reads no comm message while a cell runs; interrupting the
      // kernel ends a running %%mesh cell, and the magic interrupts the mesh's ranks.
      void kernel.interrupt();
      this._setStatus(`Interrupted the kernel's running cell (the kernel was busy).`);
      return;
    }
    this._ask('interrupt', mesh, `Interrupting mesh ${mesh}\u2026`);
  }

  private async _down(mesh: string): Promise<void> {
    const answer = await showDialog({
      title: `Bring mesh ${mesh} down?`,
      body: 'Every rank of the mesh stops, and what its namespaces hold is lost.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Bring down' })]
    });
    if (answer.button.accept) {
      this._ask('down', mesh, `Bringing mesh ${mesh} down\u2026`);
    }
  }

  private _insertCell(mesh: string): void {
    const notebook = this._notebook;
    if (!notebook) {
      return;
    }
    NotebookActions.insertBelow(notebook.content);
    const cell = notebook.content.activeCell;
    if (cell) {
      cell.model.sharedModel.setSource(`%%mesh --name ${mesh}\n`);
    }
    this._focus(notebook);
    notebook.content.mode = 'edit';
    cell?.editor?.setCursorPosition({ line: 1, column: 0 });
  }

  private _onResult(result: IResultMessage): void {
    if (result.action === 'logs' && result.ok && result.mesh !== undefined && result.rank !== undefined) {
      this._logs = { mesh: result.mesh, rank: result.rank, lines: result.logs ?? [] };
      this._render();
    }
    this._setStatus(result.message, result.ok);
  }

  private _notebook: NotebookPanel | null = null;
  private _link: MeshLink | null = null;
  private _collapsed = new Set<string>();
  private _logs: IShownLogs | null = null;
}
